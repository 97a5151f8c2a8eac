"""One tensor-parallel rank as its own process, driven through shared-memory rings.

``python -m trillm.gpu.worker._worker_process ARGS_JSON`` (ARGS_JSON: `WorkerProcessArgs`). The
executor (`trillm.engine`'s `MultiprocExecutor`) spawns one per rank, passing the rings'
doorbell fds with ``pass_fds``. The process reads commands from the broadcast ring (every rank
reads every command, in place) and answers on its own result ring, whose writer it is.

Wire ABI (record kinds; never renumber, only add):

========================  ====================================  ============================
command (broadcast ring)  payload                               reply (result ring)
========================  ====================================  ============================
``CMD_LOAD``              empty                                 ``REPLY_NUM_BLOCKS`` u64, then
                                                                `KernelChoice` msgpack
``CMD_INIT_KV``           u64 number of KV blocks               ``REPLY_OK`` empty
``CMD_STEP``              `StepBatchCodec` msgpack              rank 0: ``REPLY_OUTPUT``
                                                                (`RunnerOutputCodec`); others
                                                                nothing
``CMD_SHUTDOWN``          empty                                 none; the process exits 0
``CMD_SLEEP``             u64 sleep level (1 or 2)              ``REPLY_OK`` empty
``CMD_WAKE_UP``           empty                                 ``REPLY_OK`` empty
``CMD_ADD_LORA``          `LoraModule` msgpack                  ``REPLY_LORA``: msgpack
                                                                [ok, digest or why not]
``CMD_REMOVE_LORA``       u64 adapter id                        ``REPLY_OK`` empty
========================  ====================================  ============================

Any exception ends the process with exit code 1 after one ``REPLY_FAILURE`` record:
``[u64 CLOCK_MONOTONIC ns when caught][WorkerFailure msgpack]``. The time lets the executor
tell the root cause from its consequences (a rank whose peer died fails in a collective
later), because ``CLOCK_MONOTONIC`` is one clock for every process on the machine.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time
import traceback
from typing import Final

import msgspec
import torch
import trio

from ...common.config import WorkerConfig
from ...common.process import ParentDiedError, die_with_parent, set_title
from ...common.wire import LoraModule
from ...transport_shm import Heartbeat, RingAddress, RingReader, RingWriter
from .._step_batch import RunnerOutputCodec, StepBatchCodec
from ..lora._lora_files import LoraAdapterError
from ._config import torch_device
from ._failure import WorkerFailure
from ._worker import Worker

CMD_LOAD: Final = 1
CMD_INIT_KV: Final = 2
CMD_STEP: Final = 3
CMD_SHUTDOWN: Final = 4
CMD_SLEEP: Final = 5
CMD_WAKE_UP: Final = 6
CMD_ADD_LORA: Final = 7
CMD_REMOVE_LORA: Final = 8
REPLY_NUM_BLOCKS: Final = 101
REPLY_OK: Final = 102
REPLY_OUTPUT: Final = 103
REPLY_FAILURE: Final = 104
REPLY_LORA: Final = 105

U64: Final = struct.Struct("<Q")
# Seconds between a rank's beats of its result ring's heartbeat word: the executor declares a
# rank whose beats stopped for its watchdog timeout (SIGSTOP, frozen) not responding.
HEARTBEAT_INTERVAL: Final = 0.1
FAILURE_REPORT_TIMEOUT: Final = 10.0  # seconds; the executor may already have stopped reading


class WorkerProcessArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker process is told on its command line (JSON)."""

    config: WorkerConfig
    rank: int
    world_size: int
    dist_init_method: str | None
    commands: RingAddress  # the broadcast ring; we are reader `reader_index`
    reader_index: int
    results: RingAddress  # our result ring; we are its writer
    parent_pid: int  # the executor's pid, to close the parent-death race


class _Server:
    """The command loop of one rank; `serve` returns when told to shut down."""

    def __init__(self, args: WorkerProcessArgs, commands: RingReader, results: RingWriter) -> None:
        self.rank = args.rank
        self.worker = Worker(
            args.config,
            rank=args.rank,
            world_size=args.world_size,
            dist_init_method=args.dist_init_method,
            local_rank=args.reader_index,  # its place on this node's ring: its GPU there
        )
        self.commands = commands
        self.results = results
        self.step_codec = StepBatchCodec()
        self.output_codec = RunnerOutputCodec()
        self.buffer = bytearray()  # reused for every encoded output

    def serve(self) -> None:
        commands, worker = self.commands, self.worker
        while True:
            try:
                kind, payload = commands.peek()
            except trio.BrokenResourceError:  # the executor closed the ring: same as SHUTDOWN
                kind, payload = CMD_SHUTDOWN, memoryview(b"")
            if kind == CMD_STEP:
                batch = self.step_codec.decode(payload)  # copies out: the space is free again
                commands.release()
                output = worker.execute(batch)
                if self.rank == 0:
                    self.output_codec.encode_into(output, self.buffer)
                    self.reply(REPLY_OUTPUT, self.buffer)
            elif kind == CMD_INIT_KV:
                (num_blocks,) = U64.unpack_from(payload)
                commands.release()
                worker.init_kv_cache(num_blocks)
                self.reply(REPLY_OK, b"")
            elif kind == CMD_LOAD:
                commands.release()
                worker.init_device()
                worker.load_model()
                num_blocks = U64.pack(worker.num_available_kv_blocks())
                self.reply(REPLY_NUM_BLOCKS, num_blocks + msgspec.msgpack.encode(worker.kernels))
            elif kind in (CMD_SLEEP, CMD_WAKE_UP):
                level = U64.unpack_from(payload)[0] if kind == CMD_SLEEP else 0
                commands.release()
                if level:
                    worker.sleep(level)
                else:
                    worker.wake_up()
                self.reply(REPLY_OK, b"")
            elif kind == CMD_ADD_LORA:
                module = msgspec.msgpack.decode(payload, type=LoraModule)
                commands.release()
                try:  # a bad adapter is the caller's mistake, not this rank's failure
                    answer: list[object] = [True, worker.add_lora(module)]
                except LoraAdapterError as exc:
                    answer = [False, str(exc)]
                except Exception as exc:  # whatever else a load raises: its answer too
                    answer = [False, f"rank {self.rank}: {type(exc).__name__}: {exc}"]
                self.reply(REPLY_LORA, msgspec.msgpack.encode(answer))
            elif kind == CMD_REMOVE_LORA:
                (lora_id,) = U64.unpack_from(payload)
                commands.release()
                worker.remove_lora(lora_id)
                self.reply(REPLY_OK, b"")
            elif kind == CMD_SHUTDOWN:
                worker.shutdown()
                return
            else:
                raise ValueError(
                    f"unknown command kind {kind} (executor and worker versions differ?)"
                )

    def reply(self, kind: int, data: bytes | bytearray) -> None:
        self.results.reserve(len(data))[:] = data
        self.results.commit(kind)


def report_failure(results: RingWriter, rank: int, exc: BaseException) -> None:
    """Send the FAILURE record for `exc`; best effort (the executor may be gone)."""
    failed_at = U64.pack(time.monotonic_ns())
    failure = WorkerFailure.from_exception(rank, exc)
    record = failed_at + msgspec.msgpack.encode(failure)
    if len(record) > results.max_record_bytes:  # keep the traceback's end: it names the raise
        keep = results.max_record_bytes // 10  # characters; UTF-8 takes at most 4 bytes each
        failure = msgspec.structs.replace(
            failure, message=failure.message[:keep], traceback=failure.traceback[-keep:]
        )
        record = failed_at + msgspec.msgpack.encode(failure)
    try:
        results.send(REPLY_FAILURE, record, timeout=FAILURE_REPORT_TIMEOUT)
    except Exception as send_error:  # nobody reads it: stderr is all that is left
        print(f"worker rank {rank}: cannot report its failure: {send_error!r}", file=sys.stderr)
        traceback.print_exception(exc)


def run(args: WorkerProcessArgs) -> int:
    """Attach both rings, serve commands, and return the exit code (1 after a failure)."""
    die_with_parent(args.parent_pid)
    set_title(f"trillm::worker_{args.rank}")  # `ps` and py-spy show the rank
    # Ctrl-C in a terminal reaches the whole process group; the executor decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if torch_device(args.config).type == "cpu":  # ranks share the cores, not each take all
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.world_size))
    with RingWriter.attach(args.results) as results:
        try:
            with (
                RingReader.attach(args.commands, args.reader_index) as commands,
                Heartbeat(results, HEARTBEAT_INTERVAL, name="trillm-rank-heartbeat"),
            ):
                _Server(args, commands, results).serve()
        except Exception as exc:
            report_failure(results, args.rank, exc)
            return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            f"usage: python -m trillm.gpu.worker._worker_process ARGS_JSON (got {argv[1:]})",
            file=sys.stderr,
        )
        return 2
    try:
        return run(msgspec.json.decode(argv[1], type=WorkerProcessArgs))
    except ParentDiedError as exc:
        print(f"worker: {exc}; exiting", file=sys.stderr)
        return 1


if __name__ == "__main__":
    code = main(sys.argv)
    if code:
        # A failed rank skips interpreter teardown: a collective library's destructors can
        # block on peers whose step is half done, and the kernel frees all a rank holds.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
