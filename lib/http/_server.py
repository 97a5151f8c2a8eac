"""`trillm serve`: one `trio.run`; the engine supervisor and hypercorn in one nursery.

SIGINT/SIGTERM start a graceful shutdown: hypercorn stops accepting, in-flight requests get
`--shutdown-timeout` to finish, the rest end with a shutdown error event; then the engine is
drained and stopped. A second signal aborts at once.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ..engine import EngineConfig, LLMConfig, open_llm
from ..gpu import WorkerConfig
from ._app import App, ServeConfig
from ._metrics import Metrics

log = logging.getLogger("trillm.http")


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen, plus the HTTP and engine settings."""

    host: str
    port: int
    http: ServeConfig
    llm: LLMConfig


async def run_server(
    config: ServerConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Start the engine, serve until a signal, shut down gracefully."""
    async with open_llm(config.llm) as llm:
        app = App(llm, config.http, Metrics(config.http.served_model_name))
        hconfig = HypercornConfig()
        hconfig.bind = [f"{config.host}:{config.port}"]
        hconfig.graceful_timeout = config.http.shutdown_timeout + 5
        hconfig.accesslog = None
        hconfig.errorlog = None
        hconfig.keep_alive_timeout = 5
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, app, shutdown, nursery.cancel_scope)
            print(
                f"trillm: serving {config.http.served_model_name} on "
                f"http://{config.host}:{config.port}",
                file=sys.stderr,
                flush=True,
            )
            task_status.started()
            await hypercorn_serve(app, hconfig, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]
            nursery.cancel_scope.cancel()


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
    shutdown_timeout: float,
    stream_interval: int = 1,
    null_step_time: float = 0.0,
) -> ServerConfig:
    engine = EngineConfig(
        worker=worker,
        tensor_parallel_size=tensor_parallel_size,
        enable_prefix_caching=enable_prefix_caching,
        executor=executor,
        null_step_time=null_step_time,
    )
    return ServerConfig(
        host,
        port,
        ServeConfig(
            served_model_name,
            api_key=api_key,
            max_queued_requests=max_queued_requests,
            shutdown_timeout=shutdown_timeout,
            stream_interval=max(1, stream_interval),
        ),
        LLMConfig(engine, shutdown_timeout=shutdown_timeout),
    )
