"""The engine process: ``python -m trillm.engine.core <EngineArgs JSON>`` (`__main__`).

Started by the frontend (a fresh interpreter), it dies with its parent (a parent-death
signal, checked against the parent pid it was given to close the race), ignores SIGINT (a
terminal's Ctrl-C reaches the whole process group; the frontend decides how to shut down),
attaches the two rings, starts its heartbeat thread (`_heartbeat`), starts the executor and
runs the busy loop. Any exception becomes one DEAD record naming the root cause, then exit
code 1.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import traceback

import msgspec

from ...common.process import die_with_parent, set_title
from ...gpu import open_model, raised_in
from ...transport_shm import RingReader, RingWriter
from ..protocol import _messages as P
from ..protocol._config import EngineArgs, EngineConfig
from ..protocol._errors import RemoteError
from ._engine_core import EngineCore
from ._errors import WorkerDiedError
from ._heartbeat import Heartbeat
from .executor._executor import Executor, NullExecutor, UniprocExecutor


def make_executor(config: EngineConfig) -> Executor:
    kind = config.executor_kind
    if kind == "uni":
        return UniprocExecutor(config.worker)
    if kind == "null":
        model_config, _ = open_model(config.worker.model, "dummy")
        max_len = config.worker.max_model_len or model_config.max_position_embeddings
        return NullExecutor(
            model_config,
            num_blocks=config.null_num_blocks,
            max_model_len=max_len,
            step_time=config.null_step_time,
        )
    from .executor._executor_multiproc import MultiprocExecutor
    from .nodes._node_link import node_token_from_environment

    # Read here, not parsed into `config`: see `node_token_from_environment`.
    token = node_token_from_environment() if config.nnodes > 1 else None
    return MultiprocExecutor(
        config.worker, config.tensor_parallel_size, cluster=config, node_token=token
    )


def root_cause(exc: BaseException) -> RemoteError:
    if isinstance(exc, WorkerDiedError):
        return exc.error
    return RemoteError(
        "engine",
        type(exc).__qualname__,
        str(exc),
        "".join(traceback.format_exception(exc)),
        function=raised_in(exc),
    )


def process_title(config: EngineConfig) -> str:
    """`trillm::engine`, or `trillm::engine_<i>` for data-parallel engine i: `ps` and
    py-spy tell the processes apart (DESIGN.md §1; docs/debugging.md)."""
    rank = config.data_parallel_rank
    return "trillm::engine" if rank is None else f"trillm::engine_{rank}"


def main(argv: list[str]) -> int:
    args = msgspec.json.decode(argv[1], type=EngineArgs)
    set_title(process_title(args.config))
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve(args)


def serve(args: EngineArgs) -> int:
    """Attach the rings, start the heartbeat and the executor, run the busy loop; any
    exception becomes one DEAD record naming the root cause, then 1. The engine process's
    body, and the whole of an in-process engine (`--engine-in-process`: a thread of the
    frontend's process, whose title, signals and parent are the frontend's own)."""
    with (
        RingReader.attach(args.request_ring) as requests,
        RingWriter.attach(args.output_ring) as outputs,
        Heartbeat(outputs),  # from before the model loads: see `_heartbeat`
    ):
        executor: Executor | None = None
        core: EngineCore | None = None
        try:
            if args.config.cpu_threads:
                import torch

                torch.set_num_threads(args.config.cpu_threads)
            executor = make_executor(args.config)
            core = EngineCore(args.config, requests, outputs, executor)
            core.start()
            core.run()
            return 0
        except BaseException as exc:
            cause = root_cause(exc)
            if core is not None and core.step_rnums is not None:
                cause = msgspec.structs.replace(cause, step_rnums=core.step_rnums.tolist())
            with contextlib.suppress(Exception):  # the frontend is gone or stuck: exit anyway
                outputs.send(P.DEAD, msgspec.msgpack.encode(cause), timeout=5.0)
            print(cause.traceback or cause.describe(), file=sys.stderr)
            return 1
        finally:
            if executor is not None:
                executor.shutdown()
