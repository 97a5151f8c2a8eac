"""`trillm serve`: one `trio.run`; the engine supervisor and hypercorn in one nursery.

SIGINT/SIGTERM start a graceful shutdown: hypercorn stops accepting, in-flight requests get
`--shutdown-timeout` to finish, the rest end with a shutdown error event; then the engine is
drained and stopped. A second signal aborts at once.

When the engine dies, open requests end with its cause at once, `/health` and new generation
requests answer 503, and after `--engine-death-grace` seconds the server exits with the
cause and a non-zero status, so a supervisor (systemd, Kubernetes) restarts it; with
`--keep-alive-on-engine-death` it keeps answering 503 instead (vLLM's
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), for whoever wants to restart it some other way.

Under `trillm serve`'s own supervisor (`_supervisor`, the default) this runs in a child
process that listens on the supervisor's socket (`ServerConfig.listen_fd`) and says when it
serves (`ready_fd`); a crash of the child is restarted there, an exit like the above is not.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass

import msgspec.structs
import setproctitle
import trio
from hypercorn.config import Config as HypercornConfig

from ..config import WorkerConfig
from ..engine.client import (
    MAX_GRAMMAR_BYTES,
    MAX_REGEX_OPTIONALS,
    MAX_STRUCTURED_DEPTH,
    REASONING_PARSERS,
    EngineConfig,
    EngineDeadError,
    LLMConfig,
    open_llm,
)
from ._app import MAX_HEADER_BYTES, App, ServeConfig
from ._connections import Connections
from ._generate import DRAINING_LAST_WRITE_S
from ._metrics import Metrics
from ._tools import TOOL_CALL_PARSERS

log = logging.getLogger("trillm.http")
LISTEN_BACKLOG = 4096
LAST_WRITES_S = 1.0  # after the grace: the most the last error events may take


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen, plus the HTTP and engine settings."""

    host: str
    port: int
    http: ServeConfig
    llm: LLMConfig
    engine_death_grace: float = 5.0  # seconds of 503s between the engine's death and exiting
    keep_alive_on_engine_death: bool = False  # never exit for the engine's death
    # Under the supervisor (`_supervisor`): the socket it bound, to listen on instead of
    # host:port, and the pipe to write "serving" to once the server listens.
    listen_fd: int | None = None
    ready_fd: int | None = None


async def run_server(
    config: ServerConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Start the engine, serve until a signal, shut down gracefully.

    Raises:
        EngineDeadError: the engine died (after the grace period, or at shutdown if kept
            alive); the message names the root cause.
    """
    setproctitle.setproctitle("trillm::api")  # `ps` and py-spy name the frontend
    async with open_llm(config.llm) as llm:
        metrics = Metrics(config.http.served_model_name, len(llm.engines))
        metrics.set_cache_config(
            block_size=llm.ready.block_size, num_gpu_blocks=llm.ready.num_blocks
        )
        if llm.ready.kernels is not None:
            metrics.set_kernels(msgspec.structs.asdict(llm.ready.kernels))
        app = App(llm, config.http, metrics)
        # The start-up heap (torch's modules, the tokenizer: 300,000 objects) lives as long
        # as the server: frozen, a full collection walks only what requests made, instead of
        # stalling every stream for 250 ms (vLLM's freeze_gc_heap does the same).
        gc.collect()
        gc.freeze()
        hconfig = HypercornConfig()
        if config.listen_fd is not None:
            hconfig.bind = [f"fd://{config.listen_fd}"]
        else:
            hconfig.bind = [f"{config.host}:{config.port}"]
        # In-flight requests end at the shutdown timeout, then have their last writes; then
        # the connections still open are closed (a client that stopped reading holds none).
        hconfig.graceful_timeout = config.http.shutdown_timeout + DRAINING_LAST_WRITE_S
        hconfig.accesslog = None
        hconfig.errorlog = None
        hconfig.keep_alive_timeout = 5
        # A burst of connections beyond the accept queue is dropped by the kernel (the clients
        # retry after 1, 3, 7 s...); the kernel caps this at net.core.somaxconn.
        hconfig.backlog = LISTEN_BACKLOG
        hconfig.h11_max_incomplete_size = MAX_HEADER_BYTES  # a longer head: 431, closed
        hconfig.h2_max_header_list_size = MAX_HEADER_BYTES  # (the app checks every block too)
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, app, shutdown, nursery.cancel_scope)
            nursery.start_soon(_exit_on_engine_death, app, config, nursery.cancel_scope)
            if llm.ready.kernels is not None:
                print(f"trillm: {llm.ready.kernels.describe()}", file=sys.stderr, flush=True)
            print(
                f"trillm: serving {config.http.served_model_name} on "
                f"http://{config.host}:{config.port}",
                file=sys.stderr,
                flush=True,
            )
            task_status.started()
            if config.ready_fd is not None:
                os.write(config.ready_fd, b"serving\n")
                os.close(config.ready_fd)
            connections = Connections(write_timeout=config.http.write_timeout)
            await connections.serve(app, hconfig, shutdown_trigger=shutdown.wait)
            nursery.cancel_scope.cancel()
        if llm.error is not None:  # it died while serving (a shutdown has not begun yet)
            raise EngineDeadError(llm.error.error)


async def _exit_on_engine_death(
    app: App, config: ServerConfig, everything: trio.CancelScope
) -> None:
    error = await app.llm.wait_dead()
    if config.keep_alive_on_engine_death:
        print(
            f"trillm: {error}; still serving, every generation request gets 503 "
            f"(--keep-alive-on-engine-death)",
            file=sys.stderr,
            flush=True,
        )
        return
    grace = config.engine_death_grace
    print(
        f"trillm: {error}; exiting in {grace:g} s (--engine-death-grace); until then /health "
        f"and new requests get 503",
        file=sys.stderr,
        flush=True,
    )
    await trio.sleep(grace)
    with trio.move_on_after(LAST_WRITES_S):  # let open responses write their error events
        while app.generation.inflight:
            await trio.sleep(0.01)
    everything.cancel()


async def _watch_signals(app: App, shutdown: trio.Event, everything: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if shutdown.is_set():
                print("trillm: second signal, aborting", file=sys.stderr, flush=True)
                everything.cancel()
                return
            print("trillm: shutting down (again to abort)", file=sys.stderr, flush=True)
            app.generation.start_draining(app.config.shutdown_timeout)
            shutdown.set()


def build_config(
    *,
    host: str,
    port: int,
    served_model_name: str,
    worker: WorkerConfig,
    tensor_parallel_size: int,
    enable_prefix_caching: bool,
    executor: str,
    api_key: str | None,
    max_queued_requests: int,
    max_prompts_per_request: int = 1024,
    request_body_timeout: float = 30.0,
    shutdown_timeout: float,
    write_timeout: float = 30.0,
    stream_interval: int = 1,
    null_step_time: float = 0.0,
    engine_death_grace: float = 5.0,
    keep_alive_on_engine_death: bool = False,
    engine_watchdog_timeout: float = 30.0,
    structured_outputs_timeout: float = 10.0,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str = "hermes",
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
    data_parallel_size: int = 1,
    max_engine_restarts: int = 0,
    engine_restart_window: float = 300.0,
    engine_restart_wait: float = 30.0,
    engine_in_process: bool = False,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    headless: bool = False,
    distributed_timeout: float = 120.0,
    enable_dev_endpoints: bool = False,
    profiler_dir: str | None = None,
    structured_outputs_max_depth: int = MAX_STRUCTURED_DEPTH,
    structured_outputs_max_bytes: int = MAX_GRAMMAR_BYTES,
    structured_outputs_max_regex_optionals: int = MAX_REGEX_OPTIONALS,
    enable_prompt_tokens_details: bool = False,
) -> ServerConfig:
    if engine_death_grace < 0:
        raise ValueError(f"--engine-death-grace must be >= 0 seconds, got {engine_death_grace}")
    if max_prompts_per_request < 1:
        raise ValueError(f"--max-prompts-per-request must be >= 1, got {max_prompts_per_request}")
    if request_body_timeout < 0:
        raise ValueError(
            f"--request-body-timeout must be >= 0 seconds (0: none), got {request_body_timeout}"
        )
    if headless and node_rank == 0:
        raise ValueError(
            "--headless runs only a node's worker ranks, so it needs --node-rank >= 1: node 0 "
            "runs the server and the engine"
        )
    if node_rank > 0 and not headless:
        raise ValueError(
            f"--node-rank {node_rank} runs only its worker ranks: add --headless (the server "
            f"and the engine run on node 0)"
        )
    if profiler_dir is not None and not enable_dev_endpoints:
        raise ValueError(
            "--profiler-dir is for POST /start_profile, a dev endpoint: add --enable-dev-endpoints"
        )
    if nnodes > 1 and data_parallel_size > 1:
        raise ValueError("--nnodes > 1 with --data-parallel-size > 1 is not supported")
    engine = EngineConfig(
        worker=worker,
        tensor_parallel_size=tensor_parallel_size,
        enable_prefix_caching=enable_prefix_caching,
        executor=executor,
        null_step_time=null_step_time,
        structured_outputs_timeout=structured_outputs_timeout,
        worker_watchdog_timeout=engine_watchdog_timeout,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        distributed_timeout=distributed_timeout,
    )
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}"
        )
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}"
        )
    return ServerConfig(
        host,
        port,
        ServeConfig(
            served_model_name,
            api_key=api_key,
            max_queued_requests=max_queued_requests,
            max_prompts_per_request=max_prompts_per_request,
            request_body_timeout=request_body_timeout or None,  # 0: no deadline
            shutdown_timeout=shutdown_timeout,
            write_timeout=write_timeout,
            stream_interval=max(1, stream_interval),
            enable_auto_tool_choice=enable_auto_tool_choice,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            enable_dev_endpoints=enable_dev_endpoints,
            profiler_dir=profiler_dir,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
        ),
        LLMConfig(
            engine,
            shutdown_timeout=shutdown_timeout,
            watchdog_timeout=engine_watchdog_timeout,
            chat_template=chat_template,
            reasoning_parser=reasoning_parser,
            data_parallel_size=data_parallel_size,
            max_engine_restarts=max_engine_restarts,
            engine_restart_window=engine_restart_window,
            engine_restart_wait=engine_restart_wait,
            in_process=engine_in_process,
            structured_outputs_max_depth=structured_outputs_max_depth,
            structured_outputs_max_bytes=structured_outputs_max_bytes,
            structured_outputs_max_regex_optionals=structured_outputs_max_regex_optionals,
        ),
        engine_death_grace=engine_death_grace,
        keep_alive_on_engine_death=keep_alive_on_engine_death,
    )
