"""`trillm serve` as a supervisor: the API server runs in a child process, started again if it
dies, as a dead engine is (`RestartPolicy`).

Why: the API process holds native code that input reaches (tokenizers, templates, grammar
compilers). A crash there (SIGSEGV), an OOM kill or an uncaught exception ended the server,
and the engine with it (its parent-death signal), with nothing logged and nothing restarted;
engine restarts cover only the engine. Here the `trillm serve` process does nothing but
watch: the requests open in a dead child are lost (their connections close), the next child
serves on the same socket.

- **Fork, not exec.** The parent has parsed and checked the flags and imported the server
  (seconds, some 300 MB, shared copy-on-write with each child), so a restart costs the
  engine's start and no more, and every flag error is the parent's own, before any child.
  The parent never runs trio (a fork from inside a run would give the child a running
  loop): it waits in the loop below, on signals, the child's pidfd and a pipe.
- **One listening socket.** The parent binds it before the first child (a taken port fails at
  once) and keeps it; each child listens on it (`ServerConfig.listen_fd`) once its engine is
  READY, so before the first start a connection is refused as before, and across a restart
  the port stays bound and listening: new connections wait in the backlog (4,096) and the
  next child accepts them. The connections of the dead child close with it (the kernel's
  reset: an incomplete response, which the openai SDK raises as APIConnectionError and
  retries, twice by default).
- **What is restarted**: a child that was serving and died by a signal or an uncaught
  exception (status `CRASHED`), at most `--max-api-restarts` times within
  `--api-restart-window` seconds. A child that exits on purpose (0 after a signal; 1 for a
  start-up failure or an engine death past its own restarts) ends the parent with the same
  status; a death before serving is a start-up failure and is not restarted either.
- **Signals**: SIGINT and SIGTERM are forwarded to the child, which has a process group of
  its own (a terminal's Ctrl-C reaches it once, through here): the first drains, the second
  aborts, a third SIGKILLs it. Then the parent exits with the child's status, or, when the
  child was killed by the forwarded signal, by that signal too. The parent closes its copy
  of the socket at the first signal, so a draining server refuses new connections as
  before. The child dies with the parent (`PR_SET_PDEATHSIG`): `kill -9` of the parent
  takes the child, which takes its engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import NoReturn

from ..common.process import set_title
from ..engine.client import RestartPolicy
from ..http import ServerConfig

CRASHED = 70  # the child's status after an uncaught exception (EX_SOFTWARE): restart it
FORWARDED = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


def supervise(
    config: ServerConfig,
    serve: Callable[[ServerConfig], int],
    *,
    max_restarts: int,
    window: float,
) -> int:
    """Run `serve(config)` in a child process, again each time it crashes (within the
    bounds); returns the status to exit with.

    Raises:
        ValueError: a bound is out of range (names the flag), or the socket cannot be bound
            (the port is taken, ...).
    """
    if max_restarts < 1:
        raise ValueError(f"--max-api-restarts must be >= 1 to supervise, got {max_restarts}")
    if not window > 0:
        raise ValueError(f"--api-restart-window must be > 0 seconds, got {window}")
    policy = RestartPolicy(max_restarts, window)
    set_title("trillm::serve")  # the child is `trillm::api`
    with listening_socket(config.host, config.port) as sock, _SignalPipe() as signals:
        child_config = dataclasses.replace(config, listen_fd=sock.fileno())
        while True:
            child = _Child.start(child_config, serve, signals, sock, restarted=policy.total > 0)
            status = child.wait()
            if status.shutting_down or not status.is_crash:
                return status.exit_status()
            if child.served is None:
                _log(f"the API server {child.describe(status)} before it served; not restarting it")
                return 1
            if not policy.allow():
                _log(
                    f"the API server {child.describe(status)}; not restarting it: "
                    f"{policy.max_restarts} restarts within {policy.window:g} s already "
                    f"(--max-api-restarts, --api-restart-window)"
                )
                return 1
            _log(
                f"the API server {child.describe(status)}; its open requests are lost (their "
                f"connections closed); starting it again (restart {policy.total}, at most "
                f"{policy.max_restarts} within {policy.window:g} s: --max-api-restarts)"
            )


@contextlib.contextmanager
def listening_socket(host: str, port: int) -> Iterator[socket.socket]:
    """A TCP socket bound to `host:port`, not yet listening (the child listens when it serves)."""
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        yield sock
    finally:
        sock.close()


@dataclasses.dataclass(frozen=True)
class _Status:
    """How a child ended (`os.waitstatus_to_exitcode`: < 0 a signal) and what was under way."""

    code: int
    shutting_down: int  # signals forwarded to it

    @property
    def is_crash(self) -> bool:
        return self.code < 0 or self.code not in (0, 1)

    def exit_status(self) -> int:
        """The parent's status; killed by the signal it was sent, the parent dies by it too."""
        if self.code < 0 and -self.code in FORWARDED and self.shutting_down:
            _flush()
            signal.signal(-self.code, signal.SIG_DFL)
            os.kill(os.getpid(), -self.code)
        return self.code if self.code >= 0 else 1


class _Child:
    """One API-server process: started by fork, watched through its pidfd."""

    def __init__(
        self, pid: int, ready: int, signals: _SignalPipe, sock: socket.socket, restarted: bool
    ) -> None:
        self.pid = pid
        self.ready = ready  # the pipe on which it says it serves
        self.signals = signals
        self.sock = sock
        self.restarted = restarted
        self.started = time.monotonic()
        self.served: float | None = None  # time.monotonic() when it said so

    @classmethod
    def start(
        cls,
        config: ServerConfig,
        serve: Callable[[ServerConfig], int],
        signals: _SignalPipe,
        sock: socket.socket,
        *,
        restarted: bool,
    ) -> _Child:
        ready_r, ready_w = os.pipe()
        parent = os.getpid()
        _flush()  # what is buffered would be written twice
        with signals.blocked():  # the child resets the handlers before any is delivered
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                _run_child(dataclasses.replace(config, ready_fd=ready_w), serve, parent, signals)
        os.close(ready_w)
        return cls(pid, ready_r, signals, sock, restarted)

    def wait(self) -> _Status:
        """Until the child exits: forwards signals, notes when it serves."""
        forwarded = 0
        pidfd = os.pidfd_open(self.pid)
        selector = selectors.DefaultSelector()
        try:
            selector.register(pidfd, selectors.EVENT_READ)
            selector.register(self.ready, selectors.EVENT_READ)
            selector.register(self.signals.read_fd, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fd == pidfd:
                        _, status = os.waitpid(self.pid, 0)
                        return _Status(os.waitstatus_to_exitcode(status), forwarded)
                    if key.fd == self.ready:
                        if not os.read(self.ready, 64):  # EOF: it exited (or closed it)
                            selector.unregister(self.ready)
                        elif self.served is None:
                            self.served = time.monotonic()
                            if self.restarted:
                                _log(f"the API server serves again (pid {self.pid}, after "
                                     f"{self.served - self.started:.1f} s)")  # fmt: skip
                    else:
                        for signum in self.signals.read():
                            forwarded += 1
                            self._forward(signum, forwarded)
        finally:
            selector.close()
            os.close(pidfd)
            os.close(self.ready)

    def _forward(self, signum: int, forwarded: int) -> None:
        if forwarded == 1:
            self.sock.close()  # a draining server refuses new connections, as before
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL if forwarded >= 3 else signum)

    def describe(self, status: _Status) -> str:
        """ "(pid 12) was killed by signal 11 (SIGSEGV) after 3.2 s" and the like."""
        if status.code < 0:
            how = f"was killed by signal {-status.code} ({signal.Signals(-status.code).name})"
        elif status.code == CRASHED:
            how = f"exited with status {CRASHED} (an uncaught exception; its traceback is above)"
        else:
            how = f"exited with status {status.code}"
        return f"(pid {self.pid}) {how} after {time.monotonic() - self.started:.1f} s"


def _run_child(
    config: ServerConfig, serve: Callable[[ServerConfig], int], parent: int, signals: _SignalPipe
) -> NoReturn:
    """The forked child's whole life: never returns into the parent's code."""
    code = CRASHED
    try:
        signals.reset_in_child()
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent only, which forwards it
        _die_with_parent(parent)
        faulthandler.enable()  # a native crash prints every thread's Python stack first
        code = serve(config)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:  # SIGINT before the server took over its signals
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = CRASHED
    finally:
        _flush()
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


class _SignalPipe:
    """SIGINT and SIGTERM, caught in the parent and read from a pipe (`signal.set_wakeup_fd`)."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous: dict[int, object] = {}
        self._previous_fd = -1

    def __enter__(self) -> _SignalPipe:
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in FORWARDED:
            self._previous[signum] = signal.signal(signum, lambda *_: None)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self.read_fd)
        os.close(self._write_fd)

    def read(self) -> list[int]:
        """The signals caught since the last read, in order."""
        with contextlib.suppress(BlockingIOError):
            return [s for s in os.read(self.read_fd, 64) if s in FORWARDED]
        return []

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def reset_in_child(self) -> None:
        """The child's signals as a fresh process has them, then unblocked."""
        signal.set_wakeup_fd(-1)
        os.close(self.read_fd)
        os.close(self._write_fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _log(message: str) -> None:
    print(f"trillm: {message}", file=sys.stderr, flush=True)
