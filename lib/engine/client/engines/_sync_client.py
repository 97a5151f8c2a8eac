"""One engine process driven from a plain thread: the rings and records of `EngineClient`,
with blocking waits that time out instead of trio tasks (vLLM's SyncMPClient).

`trillm.LLM` (offline batches) runs on it. No task runs in the background: the caller's
thread reads the output ring while it waits (`pump`), each wait a `RingReader.peek` bounded
by `POLL_S`, so the supervision the trio client gets from its tasks happens between waits:

- after a quiet wait, `Popen.poll` says whether the engine exited; if it did, the output ring
  is declared dead, its DEAD record (if it wrote one) is read first, then the exit becomes
  the root cause;
- the heartbeat word of the output ring is compared at every pump (`_watchdog`'s rule: a value
  compare, so time the caller spent away is no silence); still for `watchdog_timeout`, the
  engine is declared not responding and killed.

Death raises `EngineDeadError` naming the cause from the pump and from every later call, after
failing every open request in one pass (`OutputProcessor.fail_all`). A full request ring is
waited out by reading outputs meanwhile: the engine may itself be waiting for room in the
output ring before it reads requests again.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Any, NoReturn

import trio

from ....transport_shm import BusyError, Record
from ...protocol import _messages as P
from ...protocol._config import EngineConfig
from ...protocol._errors import RemoteError, death_message
from ...protocol._step_record import StepView
from .._errors import EngineDeadError
from ..outputs._output_processor import OutputProcessor
from ._connection import EngineConnection, Outgoing, ProtocolError
from ._launch import exit_error, spawn_engine, wait_ready
from ._watchdog import not_responding_error

POLL_S = 0.1  # the longest one wait sleeps before it looks at the engine process again
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


class SyncEngineClient:
    """The engine process of `config`, started at once; `wait_ready` before anything else.

    The engine's parent-death signal follows the thread that built this: build it on a thread
    that lives as long as it (the main thread, as a rule). One thread at a time may call it.
    """

    def __init__(
        self, config: EngineConfig, processor: OutputProcessor, *, watchdog_timeout: float
    ) -> None:
        self.config = config
        self.processor = processor
        self.watchdog_timeout = watchdog_timeout
        self.error: EngineDeadError | None = None  # set once it died or was shut down
        self.connection = EngineConnection()
        self._to_abort: list[int] = []  # finished by a stop string while reading
        self._closed = False
        self.process, self.requests, self.outputs = spawn_engine(config)
        self._beat, self._beat_at = self.outputs.heartbeat_of_writer(), time.monotonic()

    def wait_ready(self, timeout: float) -> P.Ready:
        """READY from the engine, or `EngineStartError` with its root cause."""
        self.ready = wait_ready(self.process, self.requests, self.outputs, timeout)
        self._beat, self._beat_at = self.outputs.heartbeat_of_writer(), time.monotonic()
        return self.ready

    # -- sending ---------------------------------------------------------------------------

    def send_add(
        self, rnum: int, options: Any, max_tokens: int, ids: list[int], *, cache_salt: str = ""
    ) -> None:
        """ADD request `rnum`: prompt `ids`, at most `max_tokens` new ones."""
        record = self.connection.encode_add(rnum, options, max_tokens, ids, cache_salt=cache_salt)
        self._send(record)

    def send_abort(self, rnums: list[int]) -> None:
        self._send(self.connection.encode_abort(rnums))

    def _send(self, record: Outgoing) -> None:
        record.write(self._reserve(record.size))
        self.requests.commit(record.kind)

    def _reserve(self, size: int) -> memoryview:
        """Room in the request ring; while there is none, outputs are read (see the module)."""
        while True:
            self.check_alive()
            try:
                view = self.requests.try_reserve(size)
            except _GONE:  # the engine closed its end: it is exiting; learn how
                self._wait_death()
            if view is not None:
                return view
            self._read(POLL_S / 10)

    # -- receiving -------------------------------------------------------------------------

    def pump(self, timeout: float = POLL_S) -> None:
        """Handle what the engine sends within `timeout` seconds (what has arrived, else the
        first record to arrive); then abort in the engine what stop strings finished.

        Raises:
            EngineDeadError: the engine died (now or before), naming the root cause.
        """
        self._read(timeout)
        if self._to_abort:
            rnums, self._to_abort = self._to_abort, []
            self.send_abort(rnums)

    def _read(self, timeout: float) -> None:
        self.check_alive()
        self._watch_heartbeat()
        reader = self.outputs
        record: Record | None
        try:
            record = reader.peek(timeout=timeout)
        except BusyError:
            self._check_exited()
            return
        except _GONE:  # declared dead by `_check_exited` and everything read: no DEAD record
            self._die(exit_error(self.process))
        while record is not None:
            try:
                message = self.connection.receive(*record)
            except ProtocolError:  # an unknown kind from a newer engine: not ours to read
                message = None
            if isinstance(message, StepView):
                self._to_abort += self.processor.process_step(message)
            elif isinstance(message, P.PromptLogprobsChunk | P.RequestError):
                self.processor.process_event(message)
            elif isinstance(message, RemoteError):
                reader.release()
                self._die(message)
            reader.release()
            try:
                record = reader.try_peek()
            except _GONE:
                record = None  # the next read tells the cause

    def _check_exited(self) -> None:
        if self.process.poll() is not None:  # reaped; what it published is still read
            self.outputs.declare_peer_dead(death_message(exit_error(self.process)))

    def _watch_heartbeat(self) -> None:
        if not self.watchdog_timeout:
            return
        beat, now = self.outputs.heartbeat_of_writer(), time.monotonic()
        if beat != self._beat:
            self._beat, self._beat_at = beat, now
        elif now - self._beat_at >= self.watchdog_timeout:
            error = not_responding_error(
                self.process.pid, now - self._beat_at, self.watchdog_timeout
            )
            self.process.kill()  # its workers die with it
            self.process.wait()
            self._die(error)

    def _wait_death(self, timeout: float = 10.0) -> NoReturn:
        """The engine is going: read until its cause is known (killing it past `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline and self.process.poll() is None:
                self.process.kill()
            self._read(POLL_S)

    def check_alive(self) -> None:
        """Raise the `EngineDeadError` of the engine's death, if it died."""
        if self.error is not None:
            raise self.error

    def _die(self, error: RemoteError) -> NoReturn:
        self.error = EngineDeadError(error)
        self.processor.fail(self.error)
        raise self.error

    # -- life ------------------------------------------------------------------------------

    @property
    def is_closed(self) -> bool:
        """True once `shutdown` ran (the engine is gone, the rings closed)."""
        return self._closed

    def shutdown(self, timeout: float, *, drain: bool = True) -> None:
        """Drain the engine (at most `timeout` s), make sure it is gone, close the rings.

        A second call does nothing. `drain=False` kills it at once (a failed start).
        """
        if self._closed:
            return
        self._closed = True
        try:
            if drain and self.error is None and self.process.poll() is None:
                self._send_shutdown(timeout)
                deadline = time.monotonic() + timeout + 5
                while self.process.poll() is None and time.monotonic() < deadline:
                    self._discard_outputs()
        finally:
            if self.process.poll() is None:
                self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
            self.requests.close()
            self.outputs.close()
            if self.error is None:
                shut = RemoteError("engine", "EngineShutdown", "the engine was shut down")
                self.error = EngineDeadError(shut)

    def _send_shutdown(self, timeout: float) -> None:
        record = self.connection.encode_shutdown("drain", timeout)
        with contextlib.suppress(*_GONE):
            view = self.requests.try_reserve(record.size)
            if view is not None:
                record.write(view)
                self.requests.commit(record.kind)

    def _discard_outputs(self) -> None:
        """Read and drop one record (the engine must not block on a full output ring)."""
        try:
            self.outputs.peek(timeout=POLL_S / 2)
        except BusyError:
            return
        except _GONE:
            time.sleep(POLL_S / 2)  # it closed its end: it exits now
            return
        self.outputs.release()
