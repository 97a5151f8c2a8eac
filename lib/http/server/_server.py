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
from dataclasses import dataclass, field
from typing import Any

import msgspec.structs
import trio
from hypercorn.config import Config as HypercornConfig

from ...common.config import WorkerConfig
from ...common.flags import Flag, Option, fields_from, flag, options_of
from ...common.process import set_title
from ...engine.client import (
    REASONING_PARSERS,
    EngineConfig,
    EngineDeadError,
    LLMConfig,
    open_llm,
)
from ..edge._app import App
from ..edge._config import MAX_HEADER_BYTES, ServeConfig
from ..metrics._metrics import Metrics
from ..turn._generate import DRAINING_LAST_WRITE_S
from ..turn._tools import TOOL_CALL_PARSERS
from ._connections import Connections

log = logging.getLogger("trillm.http")
LISTEN_BACKLOG = 4096
LAST_WRITES_S = 1.0  # after the grace: the most the last error events may take


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen, plus the HTTP and engine settings.

    The engine client's shutdown deadline and reasoning parser are the server's (one flag
    each, one owner: `llm`); the HTTP layer's copies in `http` are set from them here.
    """

    host: str = field(metadata=flag("--host", cli_default="127.0.0.1"))
    port: int = field(metadata=flag("--port", cli_default=8000))
    http: ServeConfig
    llm: LLMConfig
    # Seconds of 503s between the engine's death and exiting.
    engine_death_grace: float = field(
        default=5.0,
        metadata=flag(
            "--engine-death-grace",
            help="seconds the server answers 503 after the engine died, then exits non-zero",
        ),
    )
    keep_alive_on_engine_death: bool = field(
        default=False,  # never exit for the engine's death
        metadata=flag(
            "--keep-alive-on-engine-death",
            help="keep answering 503 after the engine died instead of exiting",
        ),
    )
    # Under the supervisor (`_supervisor`): the socket it bound, to listen on instead of
    # host:port, and the pipe to write "serving" to once the server listens.
    listen_fd: int | None = None
    ready_fd: int | None = None

    @staticmethod
    def options() -> list[Option]:
        """The `trillm serve` flags the server's configs declare (the worker's aside)."""
        return [
            *EngineConfig.options(),
            *options_of(LLMConfig),
            *options_of(ServeConfig, SERVE_FLAGS),
            *options_of(ServerConfig),
        ]


# The flags of `ServeConfig`'s fields (declared here, by the code that builds it, so that
# `_app` stays about the app). The shutdown deadline and the reasoning parser are
# `LLMConfig`'s alone: the app reads them there.
SERVE_FLAGS = {
    "max_queued_requests": Flag(
        ("--max-queued-requests",),
        "completions admitted and not finished, each prompt x n counted; beyond: 429",
    ),
    "max_prompts_per_request": Flag(
        ("--max-prompts-per-request",),
        "prompts x n in one request (a completions batch); beyond: 400",
    ),
    "request_body_timeout": Flag(  # 0 is None: no deadline
        ("--request-body-timeout",),
        "seconds a request body may take to arrive; then 408 and the connection is closed "
        "(0: no limit)",
    ),
    "write_timeout": Flag(
        ("--write-timeout",),
        "seconds a response write may wait for a client that stopped reading; then the "
        "request is aborted",
    ),
    "stream_interval": Flag(("--stream-interval",), "tokens per streamed chunk (at least)"),
    "enable_auto_tool_choice": Flag(
        ("--enable-auto-tool-choice",),
        'allow tool_choice "auto" (and tools sent without a tool_choice): the model chooses '
        "between text and tool calls; --no-enable-auto-tool-choice refuses them, as vLLM does",
    ),
    "enable_prompt_tokens_details": Flag(
        ("--enable-prompt-tokens-details",),
        "report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
        "cache); off, it is null: the count tells a client what others sent before",
    ),
    "enable_runtime_lora_updating": Flag(
        ("--enable-runtime-lora-updating",),
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); needs --enable-lora",
    ),
    "enable_tokenizer_info_endpoint": Flag(
        ("--enable-tokenizer-info-endpoint",),
        "serve GET /tokenizer_info (vLLM's): the tokenizer's configuration, special tokens "
        "and chat template",
    ),
    "responses_store_size": Flag(
        ("--responses-store-size",),
        "responses the Responses API keeps in memory for GET /v1/responses/{id} and "
        "previous_response_id, least recently used first out (0: keep none; all are lost "
        "at a restart)",
    ),
    "tool_call_parser": Flag(
        ("--tool-call-parser",),
        "the tool-call format: hermes (<tool_call>{...}</tool_call>) or llama3_json",
        choices=TOOL_CALL_PARSERS,
    ),
    "enable_dev_endpoints": Flag(
        ("--enable-dev-endpoints",),
        "serve POST /sleep, /wake_up, /pause, /resume, /reset_prefix_cache, /start_profile, "
        "/stop_profile and GET /is_sleeping, /is_paused (vLLM's VLLM_SERVER_DEV_MODE); behind "
        "--api-key when set",
    ),
    "profiler_dir": Flag(
        ("--profiler-dir",), "where POST /start_profile's torch profiler traces are written"
    ),
}


async def run_server(
    config: ServerConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Start the engine, serve until a signal, shut down gracefully.

    Raises:
        EngineDeadError: the engine died (after the grace period, or at shutdown if kept
            alive); the message names the root cause.
    """
    set_title("trillm::api")  # `ps` and py-spy name the frontend
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
        hconfig.graceful_timeout = config.llm.shutdown_timeout + DRAINING_LAST_WRITE_S
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
            await nursery.start(app.run_background)
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
            app.generation.start_draining(app.llm.config.shutdown_timeout)
            shutdown.set()


def build_config(
    *,
    worker: WorkerConfig,
    served_model_name: str,
    api_key: str | None = None,
    headless: bool = False,
    **flags: Any,
) -> ServerConfig:
    """The server's configs from `trillm serve`'s flag values, each by its dest (--max-num-seqs:
    max_num_seqs; `ServerConfig.options`); a flag left out takes its field's default.

    Raises:
        TypeError: a keyword that is no flag of the server's configs.
        ValueError: a value out of range, or flags that do not go together (named).
    """
    options = ServerConfig.options()
    unknown = sorted(set(flags) - {o.flag.dest for o in options})
    if unknown:
        raise TypeError(f"build_config() got an unexpected flag {unknown[0]!r}")
    _check_flags({o.flag.dest: o.default for o in options} | flags, headless=headless)
    llm = fields_from(options_of(LLMConfig), flags)
    engine = EngineConfig(
        worker=worker,
        # The ranks' watchdog (TP > 1) is the engine's: one flag.
        worker_watchdog_timeout=llm.get("watchdog_timeout", LLMConfig.watchdog_timeout),
        **fields_from(EngineConfig.options(), flags),
    )
    for module in engine.lora_modules:
        if module.name == served_model_name:
            raise ValueError(
                f"--lora-modules: the adapter name {module.name!r} is the served model's name "
                f"(--served-model-name): requests for the model would run through the adapter; "
                f"give the adapter another name"
            )
    tool_call_parser = flags.get("tool_call_parser", "hermes")
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}"
        )
    reasoning_parser = flags.get("reasoning_parser")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}"
        )
    http = fields_from(options_of(ServeConfig, SERVE_FLAGS), flags)
    if "request_body_timeout" in http:
        http["request_body_timeout"] = http["request_body_timeout"] or None  # 0: no deadline
    if "stream_interval" in http:
        http["stream_interval"] = max(1, http["stream_interval"])
    return ServerConfig(
        http=ServeConfig(served_model_name, api_key=api_key, **http),
        llm=LLMConfig(engine, **llm),
        **fields_from(options_of(ServerConfig), flags),
    )


def _check_flags(flags: dict[str, Any], *, headless: bool) -> None:
    """Refuse what the configs cannot see alone (flags that do not go together)."""
    if flags["engine_death_grace"] < 0:
        raise ValueError(
            f"--engine-death-grace must be >= 0 seconds, got {flags['engine_death_grace']}"
        )
    if flags["max_prompts_per_request"] < 1:
        raise ValueError(
            f"--max-prompts-per-request must be >= 1, got {flags['max_prompts_per_request']}"
        )
    if flags["responses_store_size"] < 0:
        raise ValueError(
            f"--responses-store-size must be >= 0 (0: store none), got "
            f"{flags['responses_store_size']}"
        )
    if flags["request_body_timeout"] < 0:
        raise ValueError(
            f"--request-body-timeout must be >= 0 seconds (0: none), got "
            f"{flags['request_body_timeout']}"
        )
    node_rank = flags["node_rank"]
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
    if flags["profiler_dir"] is not None and not flags["enable_dev_endpoints"]:
        raise ValueError(
            "--profiler-dir is for POST /start_profile, a dev endpoint: add --enable-dev-endpoints"
        )
    if flags["nnodes"] > 1 and flags["data_parallel_size"] > 1:
        raise ValueError("--nnodes > 1 with --data-parallel-size > 1 is not supported")
