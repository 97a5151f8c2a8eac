"""One worker process per tensor-parallel rank, driven through shared-memory rings.

Each step's `StepBatch` is encoded once into the broadcast ring, which every rank reads in
place; each rank answers on its own result ring (rank 0 with the sampled tokens, every rank
with a FAILURE record when it raises). The wire kinds are `trillm.gpu._worker_process`'s.

Supervision: every process is watched by a pidfd. Waits on a ring are cut into slices of
`WATCH_INTERVAL`; between slices every rank is swept (a FAILURE record on any result ring, a
readable pidfd), so a rank that raised or died is noticed whatever we were waiting for, and
no call waits forever on a dead rank. When several ranks failed, the root cause is reported:
each failure is dated (FAILURE records carry the worker's ``CLOCK_MONOTONIC`` time; a death
without one is dated to the last sweep that saw the process alive, its earliest possible
time) and the earliest wins. A rank whose peer died fails later, in a collective, so its
error is never mistaken for the cause.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Final, Self

import msgspec
import trio

from ...gpu import (
    KernelChoice,
    RunnerOutput,
    RunnerOutputCodec,
    StepBatch,
    StepBatchCodec,
    WorkerConfig,
    WorkerFailure,
    open_model,
)
from ...gpu import _worker_process as W
from ...gpu._process import is_exiting
from ...transport_shm import BusyError, Record, RingReader, RingWriter
from ..protocol._errors import RemoteError
from ._errors import WorkerDiedError
from ._executor import Executor, Masks

WATCH_INTERVAL: Final = 0.02  # seconds between sweeps while a ring wait is blocked
SIDE_RING_CAPACITY: Final = 1 << 20  # result rings of ranks > 0: replies to LOAD and failures


def free_tcp_port() -> int:
    """A port free on 127.0.0.1 now, for torch.distributed's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Rank:
    """One worker process as the executor sees it."""

    rank: int
    process: subprocess.Popen[bytes]
    pidfd: int
    results: RingReader
    alive_at_ns: int  # the last sweep that saw it alive: a lower bound of its death
    failure: WorkerFailure | None = None
    failed_at_ns: int = 0
    returncode: int | None = None
    exiting: bool = False  # its exit has begun, its pidfd is not readable yet

    @property
    def has_failed(self) -> bool:
        return self.failure is not None or self.returncode is not None

    @property
    def failed_since_ns(self) -> int:
        """The earliest time its failure can have happened."""
        return self.failed_at_ns if self.failure is not None else self.alive_at_ns

    def remote_error(self) -> RemoteError:
        code = self.returncode
        signal = -code if code is not None and code < 0 else None
        exit_code = code if code is not None and code >= 0 else None
        where = f"worker rank {self.rank}"
        if self.failure is None:
            return RemoteError(where, exit_code=exit_code, signal=signal)
        f = self.failure
        return RemoteError(where, f.exc_type, f.message, f.traceback, exit_code, signal, f.function)

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


def _reap(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


class MultiprocExecutor(Executor):
    """Tensor parallelism over `tensor_parallel_size` worker processes.

    Create it in the thread that will outlive it: each worker gets SIGKILL when the thread
    that spawned it exits (``PR_SET_PDEATHSIG``), so no rank outlives its executor.

    Args:
        ring_capacity: bytes of the broadcast ring and of rank 0's result ring (a power of
            two); one step's encoded batch or output must fit.
        shutdown_timeout: seconds `shutdown` waits for the ranks to exit before killing them.

    Raises:
        WorkerDiedError: a rank raised or exited before it attached to its rings.
    """

    def __init__(
        self,
        config: WorkerConfig,
        tensor_parallel_size: int,
        *,
        ring_capacity: int = 1 << 24,
        shutdown_timeout: float = 5.0,
    ) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        self.config = config
        self.tensor_parallel_size = tensor_parallel_size
        self.block_size = config.block_size
        self.shutdown_timeout = shutdown_timeout
        self._step_codec = StepBatchCodec()
        self._output_codec = RunnerOutputCodec()
        self._buffer = bytearray()  # reused for every encoded StepBatch
        self._error: RemoteError | None = None  # the root cause, once a rank failed
        self._is_shut_down = False
        self._exits = select.poll()  # every live rank's pidfd
        side_capacity = min(ring_capacity, SIDE_RING_CAPACITY)
        dist_init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        with contextlib.ExitStack() as stack:
            self._commands = stack.enter_context(
                RingWriter.create(ring_capacity, num_readers=tensor_parallel_size)
            )
            self._ranks: list[_Rank] = []
            for rank in range(tensor_parallel_size):
                capacity = ring_capacity if rank == 0 else side_capacity
                self._ranks.append(self._spawn(stack, rank, capacity, dist_init_method))
            self._wait_attached()
            self._stack = stack.pop_all()

    def _spawn(
        self, stack: contextlib.ExitStack, rank: int, capacity: int, dist_init_method: str
    ) -> _Rank:
        """Start rank `rank`; `stack` kills and reaps it, and closes its ring and pidfd."""
        results = stack.enter_context(RingReader.create(capacity))
        args = W.WorkerProcessArgs(
            config=self.config,
            rank=rank,
            world_size=self.tensor_parallel_size,
            dist_init_method=dist_init_method,
            commands=self._commands.address,
            reader_index=rank,
            results=results.address,
            parent_pid=os.getpid(),
        )
        started_ns = time.monotonic_ns()
        process = subprocess.Popen(
            [sys.executable, "-m", "trillm.gpu._worker_process", msgspec.json.encode(args)],
            pass_fds=(*self._commands.address.fds, *results.address.fds),
            stdin=subprocess.DEVNULL,
        )
        stack.callback(_reap, process)
        pidfd = os.pidfd_open(process.pid)
        stack.callback(os.close, pidfd)
        self._exits.register(pidfd, select.POLLIN)
        return _Rank(rank, process, pidfd, results, started_ns)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids, by rank."""
        return [rank.process.pid for rank in self._ranks]

    @property
    def returncodes(self) -> list[int | None]:
        """How each rank's process ended as far as seen (Popen's: -N for signal N), by rank."""
        return [rank.returncode for rank in self._ranks]

    # -- the executor contract --------------------------------------------------------------

    def initialize(self) -> int:
        """Load the model on every rank and size the KV cache to the smallest rank's budget.

        Raises:
            WorkerDiedError: a rank raised (a missing model, a KV budget below one block, ...)
                or died; the error names the rank and the cause.
        """
        self._check_usable()
        self._broadcast(W.CMD_LOAD, b"")
        counts: list[int] = []
        for rank in self._ranks:
            reply = self._reply(rank, W.REPLY_NUM_BLOCKS)
            counts.append(W.U64.unpack_from(reply)[0])
            if rank.rank == 0:
                self.kernels = msgspec.msgpack.decode(reply[W.U64.size :], type=KernelChoice)
            rank.results.release()
        num_blocks = min(counts)
        self._broadcast(W.CMD_INIT_KV, W.U64.pack(num_blocks))
        for rank in self._ranks:
            self._reply(rank, W.REPLY_OK)
            rank.results.release()
        # The ranks have read the model already, so this cannot fail for a reason they missed.
        load_format = "gguf" if self.config.load_format == "gguf" else "dummy"
        self.model_config = open_model(self.config.model, load_format)[0]
        self.max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        return num_blocks

    def execute(self, batch: StepBatch, masks: Masks | None = None) -> RunnerOutput:
        """Broadcast the step; its grammar bitmask rides in the same record (so here it is
        waited for before the ranks start, not overlapped with their forward)."""
        self._check_usable()
        if masks is not None and len(batch.grammar_rnums):
            batch.grammar_bitmask = masks()
        self._step_codec.encode_into(batch, self._buffer)
        self._broadcast(W.CMD_STEP, self._buffer)
        rank0 = self._ranks[0]
        payload = self._reply(rank0, W.REPLY_OUTPUT)
        try:
            return self._output_codec.decode(payload)  # copies out of the ring
        finally:
            rank0.results.release()

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a rank failed or exited while the engine was idle."""
        self._check_usable()
        self._raise_if_failed()

    def shutdown(self) -> None:
        """Ask every rank to exit, wait `shutdown_timeout`, kill the rest (idempotent).

        Leaves no process and no shared-memory name behind.
        """
        if self._is_shut_down:
            return
        self._is_shut_down = True
        try:
            with contextlib.suppress(trio.BrokenResourceError):
                if self._commands.try_reserve(0) is not None:  # full: a rank is stuck
                    self._commands.commit(W.CMD_SHUTDOWN)
            deadline = time.monotonic() + self.shutdown_timeout
            while (left := deadline - time.monotonic()) > 0 and self._reap_exited(left):
                pass
        finally:
            self._stack.close()  # kills what is left, closes pidfds and rings

    # -- rings, watched --------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._is_shut_down:
            raise trio.ClosedResourceError("the executor was shut down")
        if self._error is not None:
            raise WorkerDiedError(self._error)

    def _wait_attached(self) -> None:
        for ring in [self._commands, *(rank.results for rank in self._ranks)]:
            while True:
                try:
                    ring.wait_attached(WATCH_INTERVAL)
                    break
                except BusyError:
                    self._raise_if_failed()

    def _broadcast(self, kind: int, data: bytes | bytearray) -> None:
        while True:
            try:
                view = self._commands.reserve(len(data), WATCH_INTERVAL)
                break
            except BusyError:
                self._raise_if_failed()
            except trio.BrokenResourceError as exc:  # a rank closed its end: it is exiting
                raise self._failed(exc) from None
        view[:] = data
        self._commands.commit(kind)

    def _reply(self, rank: _Rank, kind: int) -> memoryview:
        """The payload of `rank`'s next reply, which must be of `kind`; release it after."""
        record: Record
        while True:
            try:
                record = rank.results.peek(WATCH_INTERVAL)
                break
            except BusyError:
                self._raise_if_failed()
            except trio.BrokenResourceError as exc:
                raise self._failed(exc) from None
        got, payload = record
        if got == W.REPLY_FAILURE:
            raise self._failed()
        if got != kind:
            raise RuntimeError(
                f"worker rank {rank.rank} replied with record kind {got}, expected {kind}: "
                f"the executor and the worker disagree on the wire ABI; reinstall trillm"
            )
        return payload

    # -- supervision -----------------------------------------------------------------------

    def _sweep(self) -> None:
        """Collect FAILURE records and exits of every rank; never blocks.

        Rings first, pidfds second, and a rank that has begun to exit is not seen alive: a
        killed rank closes its sockets (so a peer's collective fails and reports) before its
        pidfd turns readable, and under load that gap is long enough for a sweep to fall in
        it. Its `alive_at_ns` then stays at the last sweep before its death began, earlier
        than any failure that death caused.
        """
        for rank in self._ranks:
            if rank.returncode is None:
                rank.take_failures(drain=False)
        now = time.monotonic_ns()
        exited = {fd for fd, _ in self._exits.poll(0)}
        for rank in self._ranks:
            if rank.returncode is not None:
                continue
            if rank.pidfd in exited:
                self._exits.unregister(rank.pidfd)
                rank.returncode = rank.process.wait()
                rank.take_failures(drain=True)
            elif is_exiting(rank.process.pid):
                rank.exiting = True
            else:
                rank.alive_at_ns = now

    def _root_cause(self) -> RemoteError | None:
        """The earliest failure, once no rank is still on its way out (it may be earlier)."""
        failed = [rank for rank in self._ranks if rank.has_failed]
        if not failed or any(rank.exiting and not rank.has_failed for rank in self._ranks):
            return None
        first = min(failed, key=lambda rank: (rank.failed_since_ns, rank.rank))
        self._error = first.remote_error()
        return self._error

    def _raise_if_failed(self) -> None:
        self._sweep()
        if (error := self._root_cause()) is not None:
            raise WorkerDiedError(error)

    def _failed(self, cause: BaseException | None = None) -> WorkerDiedError:
        """The root cause once some rank is known to have failed; waits (bounded) for it to
        show, since a rank closes its rings just before it exits."""
        deadline = time.monotonic() + self.shutdown_timeout
        while True:
            self._sweep()
            if (error := self._root_cause()) is not None:
                return WorkerDiedError(error)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._exits.poll(math.ceil(min(left, WATCH_INTERVAL) * 1000))
        self._error = RemoteError(
            "worker", type(cause).__qualname__ if cause else "", str(cause) if cause else ""
        )
        return WorkerDiedError(self._error)

    def _reap_exited(self, timeout: float) -> bool:
        """Wait up to `timeout` for a rank to exit and reap it; False once none is left."""
        if all(rank.returncode is not None for rank in self._ranks):
            return False
        for fd, _ in self._exits.poll(math.ceil(timeout * 1000)):
            self._exits.unregister(fd)
            rank = next(rank for rank in self._ranks if rank.pidfd == fd)
            rank.returncode = rank.process.wait()
        return True
