"""Worker ranks as a supervisor sees them: spawned here (local) or on another node (remote).

Both the multiproc executor (node 0) and the node agent (nodes > 0) spawn local ranks and
sweep them the same way: FAILURE records first, pidfds second, and a rank that has begun to
exit is not seen alive (see `sweep_local`). A remote rank (`_remote_nodes.RemoteRank`) keeps
the same state, filled from its node agent's frames instead of a ring and a pidfd.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec
import trio

from ....common.process import is_exiting, process_state
from ....gpu import WorkerConfig, WorkerFailure
from ....gpu import worker_process as W
from ....transport_shm import Record, RingAddress, RingReader
from ...protocol._errors import RemoteError
from ..nodes._node_link import without_node_token


def free_tcp_port() -> int:
    """A port free on 127.0.0.1 now, for torch.distributed's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ResultSource(Protocol):
    """What a rank's replies are read from: its result ring, or its node's frames."""

    def try_peek(self) -> Record | None: ...
    def peek(self, timeout: float | None = None) -> Record: ...
    def release(self) -> None: ...


@dataclass
class RankState:
    """One rank's replies and failure as its supervisor knows them."""

    rank: int
    results: ResultSource
    alive_at_ns: int  # the last sweep that saw it alive: a lower bound of its death
    where: str = ""
    failure: WorkerFailure | None = None
    failed_at_ns: int = 0
    returncode: int | None = None
    exiting: bool = False  # its exit has begun, its pidfd is not readable yet
    lost: RemoteError | None = None  # its node is gone: what is known of why
    stalled: RemoteError | None = None  # its heartbeat stopped for the watchdog timeout
    beat: int = -1  # its heartbeat word as last read, and since when it has not moved
    beat_moved_ns: int = 0

    def __post_init__(self) -> None:
        self.where = self.where or f"worker rank {self.rank}"

    @property
    def has_failed(self) -> bool:
        return (
            self.failure is not None
            or self.returncode is not None
            or self.lost is not None
            or self.stalled is not None
        )

    @property
    def failed_since_ns(self) -> int:
        """The earliest time its failure can have happened."""
        if self.failure is not None or self.stalled is not None:
            return self.failed_at_ns
        return self.alive_at_ns

    def remote_error(self) -> RemoteError:
        if self.stalled is not None:  # its SIGKILL came from us, after it stopped responding
            return self.stalled
        code = self.returncode
        signal = -code if code is not None and code < 0 else None
        exit_code = code if code is not None and code >= 0 else None
        if self.failure is not None:
            f = self.failure
            return RemoteError(
                self.where, f.exc_type, f.message, f.traceback, exit_code, signal, f.function
            )
        if self.lost is not None and code is None:
            return self.lost
        return RemoteError(self.where, exit_code=exit_code, signal=signal)

    def take_failures(self, *, drain: bool) -> None:
        """Read FAILURE records at the front of the result ring (or all records, if `drain`:
        the rank is dead and its other replies will never be read)."""
        ring = self.results
        while True:
            try:
                record = ring.try_peek()
            except trio.BrokenResourceError:  # it closed its end: everything was read
                return
            if record is None:
                return
            kind, payload = record
            if kind == W.REPLY_FAILURE and self.failure is None:
                (self.failed_at_ns,) = W.U64.unpack_from(payload)
                self.failure = msgspec.msgpack.decode(payload[8:], type=WorkerFailure)
            elif kind != W.REPLY_FAILURE and not drain:
                return  # an ordinary reply: whoever waits for it reads it
            ring.release()


@dataclass
class LocalRank(RankState):
    """A rank this process spawned: its process, pidfd and result ring."""

    process: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    ring: RingReader | None = None  # `results`, as the ring it is (to wait for attaching)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else -1


def reap(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def spawn_rank(
    stack: contextlib.ExitStack,
    exits: select.poll,
    args: W.WorkerProcessArgs,
    results: RingReader,
    commands: RingAddress,
) -> LocalRank:
    """Start the worker process of `args`; `stack` kills and reaps it and closes its pidfd."""
    started_ns = time.monotonic_ns()
    process = subprocess.Popen(
        [sys.executable, "-m", "trillm.gpu.worker._worker_process", msgspec.json.encode(args)],
        pass_fds=(*commands.fds, *results.address.fds),
        stdin=subprocess.DEVNULL,
        env=without_node_token(),
    )
    stack.callback(reap, process)
    pidfd = os.pidfd_open(process.pid)
    stack.callback(os.close, pidfd)
    exits.register(pidfd, select.POLLIN)
    return LocalRank(args.rank, results, started_ns, process=process, pidfd=pidfd, ring=results)


def worker_args(
    config: WorkerConfig,
    *,
    rank: int,
    world_size: int,
    reader_index: int,
    dist_init_method: str,
    commands: RingAddress,
    results: RingReader,
) -> W.WorkerProcessArgs:
    return W.WorkerProcessArgs(
        config=config,
        rank=rank,
        world_size=world_size,
        dist_init_method=dist_init_method,
        commands=commands,
        reader_index=reader_index,
        results=results.address,
        parent_pid=os.getpid(),
    )


def sweep_local(
    ranks: list[LocalRank], exits: select.poll, watchdog_timeout: float = 0.0
) -> list[LocalRank]:
    """Collect FAILURE records and exits of `ranks`; never blocks. Returns those that exited.

    Rings first, pidfds second, and a rank that has begun to exit is not seen alive: a
    killed rank closes its sockets (so a peer's collective fails and reports) before its
    pidfd turns readable, and under load that gap is long enough for a sweep to fall in
    it. Its `alive_at_ns` then stays at the last sweep before its death began, earlier
    than any failure that death caused.
    """
    for rank in ranks:
        if rank.returncode is None:
            rank.take_failures(drain=False)
    now = time.monotonic_ns()
    ready = {fd for fd, _ in exits.poll(0)}
    exited: list[LocalRank] = []
    for rank in ranks:
        if rank.returncode is not None or rank.process is None:
            continue
        if rank.pidfd in ready:
            exits.unregister(rank.pidfd)
            rank.returncode = rank.process.wait()
            rank.take_failures(drain=True)
            exited.append(rank)
        elif is_exiting(rank.process.pid):
            rank.exiting = True
        else:
            if (
                watchdog_timeout
                and rank.stalled is None
                and not _beating(rank, now, watchdog_timeout)
            ):
                continue  # stopped responding: no longer seen alive (killed, reported)
            rank.alive_at_ns = now
    return exited


def _beating(rank: LocalRank, now: int, timeout: float) -> bool:
    """Whether `rank`'s heartbeat moved within `timeout`; if not, it is declared not
    responding (its /proc state says why: "T (stopped)"...) and killed, so that collectives
    waiting on it fail and its pidfd reports the exit."""
    if rank.ring is None or rank.process is None:
        return True
    try:
        beat = rank.ring.heartbeat_of_writer()
    except (ValueError, TypeError):  # the ring is closed: the rank is on its way out
        return True
    if beat == 0:  # it has not begun to beat (still importing): start-up has its own bound
        return True
    if beat != rank.beat or not rank.beat_moved_ns:
        rank.beat, rank.beat_moved_ns = beat, now
        return True
    still = (now - rank.beat_moved_ns) / 1e9
    if still < timeout:
        return True
    state = process_state(rank.process.pid)
    rank.stalled = RemoteError(
        rank.where,
        "WorkerNotRespondingError",
        f"no heartbeat from {rank.where} (pid {rank.process.pid}"
        + (f", state {state}" if state else "")
        + f") for {still:.1f} s, more than the watchdog timeout of {timeout:g} s "
        "(--engine-watchdog-timeout); it was killed with SIGKILL",
    )
    rank.failed_at_ns = rank.beat_moved_ns  # it can have stopped as early as its last beat
    rank.process.kill()
    return False


def reap_exited(ranks: list[LocalRank], exits: select.poll, timeout: float) -> bool:
    """Wait up to `timeout` for a rank to exit and reap it; False once none is left."""
    if all(rank.returncode is not None for rank in ranks):
        return False
    for fd, _ in exits.poll(max(0, int(timeout * 1000) + 1)):
        exits.unregister(fd)
        rank = next(rank for rank in ranks if rank.pidfd == fd)
        if rank.process is not None:
            rank.returncode = rank.process.wait()
    return True
