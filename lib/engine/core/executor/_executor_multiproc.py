"""One worker process per tensor-parallel rank, driven through shared-memory rings.

Each step's `StepBatch` is encoded once into the broadcast ring, which every rank reads in
place; each rank answers on its own result ring (rank 0 with the sampled tokens, every rank
with a FAILURE record when it raises). The wire kinds are `trillm.gpu.worker._worker_process`'s.

Supervision: every process is watched by a pidfd. Waits on a ring are cut into slices of
`WATCH_INTERVAL`; between slices every rank is swept (a FAILURE record on any result ring, a
readable pidfd), so a rank that raised or died is noticed whatever we were waiting for, and
no call waits forever on a dead rank. When several ranks failed, the root cause is reported:
each failure is dated (FAILURE records carry the worker's ``CLOCK_MONOTONIC`` time; a death
without one is dated to the last sweep that saw the process alive, its earliest possible
time) and the earliest wins. A rank whose peer died fails later, in a collective, so its
error is never mistaken for the cause.

Across nodes (`cluster.nnodes > 1`): this process runs ranks 0..L-1 of node 0 itself; the
ranks of node k live under that node's agent, reached through `_remote_nodes` (each record
is written into the local ring and sent to every agent, which writes it into its own). A
remote rank's replies, FAILURE records and exit arrive as frames, and the root cause waits
(bounded) until every node has said its ranks were alive after the earliest failure seen.
"""

from __future__ import annotations

import contextlib
import math
import select
import time
from typing import Final, Self

import msgspec
import trio

from ....common.wire import LoraModule
from ....gpu import (
    KernelChoice,
    LoraAdapterError,
    RunnerOutput,
    RunnerOutputCodec,
    StepBatch,
    StepBatchCodec,
    WorkerConfig,
    open_model,
)
from ....gpu import worker_process as W
from ....transport_shm import BusyError, Record, RingReader, RingWriter
from ...protocol._config import EngineConfig
from ...protocol._errors import RemoteError
from .._errors import WorkerDiedError
from ..nodes._node_join import accept_nodes, open_listener
from ..nodes._node_link import link_key, log
from ..nodes._remote_nodes import RemoteNode
from ._executor import Executor, Masks
from ._ranks import (
    LocalRank,
    RankState,
    free_tcp_port,
    reap_exited,
    spawn_rank,
    sweep_local,
    worker_args,
)

WATCH_INTERVAL: Final = 0.02  # seconds between sweeps while a ring wait is blocked
SIDE_RING_CAPACITY: Final = 1 << 20  # result rings of ranks > 0: replies to LOAD and failures


class MultiprocExecutor(Executor):
    """Tensor parallelism over `tensor_parallel_size` worker processes.

    Create it in the thread that will outlive it: each worker gets SIGKILL when the thread
    that spawned it exits (``PR_SET_PDEATHSIG``), so no rank outlives its executor.

    Args:
        node_token: the node link's shared secret (`cluster.nnodes > 1`; see `_node_link`).
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
        cluster: EngineConfig | None = None,
        node_token: bytes | None = None,
    ) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        nnodes = cluster.nnodes if cluster is not None else 1
        insecure = cluster is not None and cluster.insecure_node_link
        key = link_key(nnodes, node_token, insecure=insecure)  # refused before anything starts
        self.config = config
        self.tensor_parallel_size = tensor_parallel_size
        self.block_size = config.block_size
        self.shutdown_timeout = shutdown_timeout
        # A local rank whose heartbeat stopped this long is declared not responding (0: off).
        self.watchdog_timeout = cluster.worker_watchdog_timeout if cluster is not None else 0.0
        self._step_codec = StepBatchCodec()
        self._output_codec = RunnerOutputCodec()
        self._buffer = bytearray()  # reused for every encoded StepBatch
        self._error: RemoteError | None = None  # the root cause, once a rank failed
        self._is_shut_down = False
        self._exits = select.poll()  # every live local rank's pidfd
        self._nodes: list[RemoteNode] = []  # nodes > 0 (multi-node only), by node rank
        num_local = tensor_parallel_size // nnodes
        if cluster is not None and cluster.master_port is not None:
            dist_init_method = f"tcp://{cluster.master_addr}:{cluster.master_port}"
        else:
            dist_init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        side_capacity = min(ring_capacity, SIDE_RING_CAPACITY)
        with contextlib.ExitStack() as stack:
            listener = None
            if cluster is not None and nnodes > 1:
                listener = stack.enter_context(open_listener(cluster))
                if insecure:
                    log(
                        f"listening at {cluster.master_addr}:{listener.getsockname()[1]} without "
                        "a node token (--insecure-node-link): anyone who reaches it can join "
                        "and read every prompt"
                    )
            self._commands = stack.enter_context(
                RingWriter.create(ring_capacity, num_readers=num_local)
            )
            self._local: list[LocalRank] = []
            self._ranks: list[RankState] = []  # every rank, local then remote: by rank
            for rank in range(num_local):
                capacity = ring_capacity if rank == 0 else side_capacity
                results = stack.enter_context(RingReader.create(capacity))
                args = worker_args(
                    config,
                    rank=rank,
                    world_size=tensor_parallel_size,
                    reader_index=rank,
                    dist_init_method=dist_init_method,
                    commands=self._commands.address,
                    results=results,
                )
                local = spawn_rank(stack, self._exits, args, results, self._commands.address)
                self._local.append(local)
                self._ranks.append(local)
            self._wait_attached()
            if listener is not None and cluster is not None:
                self._nodes = accept_nodes(listener, cluster, stack, self._raise_if_failed, key=key)
                listener.close()
                for node in self._nodes:
                    self._ranks += node.ranks
            self._stack = stack.pop_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def pids(self) -> list[int]:
        """The local worker processes' pids, by rank."""
        return [rank.pid for rank in self._local]

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
        self._on_every_rank(W.CMD_INIT_KV, W.U64.pack(num_blocks))
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
        for node in self._nodes:  # its ALIVE frames must not fill the socket under load
            node.pump()
        self._broadcast(W.CMD_STEP, self._buffer)
        rank0 = self._ranks[0]
        payload = self._reply(rank0, W.REPLY_OUTPUT)
        try:
            return self._output_codec.decode(payload)  # copies out of the ring
        finally:
            rank0.results.release()

    def sleep(self, level: int) -> None:
        """Every rank frees its KV cache (level 2: and moves its weights to host memory)."""
        self._check_usable()
        self._on_every_rank(W.CMD_SLEEP, W.U64.pack(level))

    def wake_up(self) -> None:
        """Every rank brings its weights back and allocates its KV cache again."""
        self._check_usable()
        self._on_every_rank(W.CMD_WAKE_UP, b"")

    def add_lora(self, module: LoraModule) -> str:
        """Every rank reads and checks the adapter; all must accept it (rank 0's digest)."""
        self._check_usable()
        self._broadcast(W.CMD_ADD_LORA, msgspec.msgpack.encode(module))
        answers = []
        for rank in self._ranks:
            answers.append(msgspec.msgpack.decode(self._reply(rank, W.REPLY_LORA)))
            rank.results.release()
        refused = [str(why) for ok, why in answers if not ok]
        if refused:  # a rank that accepted it keeps it known: harmless, no request names it
            raise LoraAdapterError(refused[0])
        return str(answers[0][1])

    def remove_lora(self, lora_id: int) -> None:
        self._check_usable()
        self._on_every_rank(W.CMD_REMOVE_LORA, W.U64.pack(lora_id))

    def _on_every_rank(self, kind: int, data: bytes) -> None:
        self._broadcast(kind, data)
        for rank in self._ranks:
            self._reply(rank, W.REPLY_OK)
            rank.results.release()

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
            for node in self._nodes:  # each agent stops its ranks, then closes
                node.send_last(W.CMD_SHUTDOWN)
            deadline = time.monotonic() + self.shutdown_timeout
            while (left := deadline - time.monotonic()) > 0:
                live = [node for node in self._nodes if not node.is_closed]
                slice_s = min(left, WATCH_INTERVAL) if live else left
                ranks_left = reap_exited(self._local, self._exits, slice_s)
                if not (live or ranks_left):
                    break
                for node in live:
                    node.pump(0 if ranks_left else slice_s)
        finally:
            self._stack.close()  # kills what is left, closes pidfds and rings

    # -- rings, watched --------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._is_shut_down:
            raise trio.ClosedResourceError("the executor was shut down")
        if self._error is not None:
            raise WorkerDiedError(self._error)

    def _wait_attached(self) -> None:
        rings: list[RingReader | RingWriter] = [self._commands]
        rings += [rank.ring for rank in self._local if rank.ring is not None]
        for ring in rings:
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
        for node in self._nodes:
            node.send(kind, data, self._raise_if_failed)

    def _reply(self, rank: RankState, kind: int) -> memoryview:
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
        """Collect FAILURE records and exits of every rank, local and remote; never blocks."""
        sweep_local(self._local, self._exits, self.watchdog_timeout)
        for node in self._nodes:
            node.pump()
            for rank in node.ranks:
                if not rank.has_failed:
                    rank.take_failures(drain=False)

    def _root_cause(self) -> RemoteError | None:
        """The earliest failure, once no rank is still on its way out (it may be earlier)."""
        failed = [rank for rank in self._ranks if rank.has_failed]
        if not failed or any(rank.exiting and not rank.has_failed for rank in self._ranks):
            return None
        first = min(failed, key=lambda rank: (rank.failed_since_ns, rank.rank))
        # A node that has not told us its ranks were alive after `first` failed may hold an
        # earlier failure; its agent says so every WATCH_INTERVAL, so wait (bounded) for it.
        since = first.failed_since_ns
        patience_ns = int(self.shutdown_timeout * 1e9)
        if time.monotonic_ns() - since < patience_ns and any(
            node.is_undecided(since) for node in self._nodes
        ):
            return None
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
