"""The `trillm` command line: `trillm serve [MODEL] [flags]`, flags named like `vllm serve`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from .. import __version__
from ._flags import ServeCommand, add_serve_flags

if TYPE_CHECKING:
    from ..http import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    """The `trillm` argument parser."""
    parser = argparse.ArgumentParser(
        prog="trillm",
        description="trillm: an LLM inference server on trio and shared-memory rings.",
    )
    parser.add_argument("--version", action="version", version=f"trillm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face directory or a GGUF file; default: the built-in "
        "SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API.",
    )
    add_serve_flags(serve)
    bench = commands.add_parser("bench", help="benchmarks (from a source checkout)")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_commands.add_parser(
        "serve",
        help="latency benchmark of an OpenAI-compatible server (perf/bench_serve.py)",
        add_help=False,
    )
    return parser


def bench_serve_main(argv: list[str]) -> int:
    """Run `perf/bench_serve.py` with `argv`; it lives in the source tree, not the package."""
    import importlib.util
    from pathlib import Path

    perf = Path(__file__).resolve().parents[2] / "perf"  # lib/cli/_command.py -> the tree
    script = perf / "bench_serve.py"
    if not script.exists():
        print(
            f"trillm bench serve needs a source checkout of trillm ({script} is missing); "
            f"run perf/bench_serve.py from the repository",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(perf))
    spec = importlib.util.spec_from_file_location("bench_serve", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result: int = module.main(argv)
    return result


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one: each connection is a file, and the
    usual soft limit (1,024) would refuse clients long before the server is busy."""
    import contextlib
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # over the kernel's nr_open: keep it
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def serve_config(args: argparse.Namespace) -> tuple[ServeCommand, ServerConfig]:
    """The command's own flags and the server's configs from `args`: each config takes the
    values of the flags its fields declare (`trillm.common.flags.fields_from`).

    Raises:
        ValueError: a value out of range, or flags that do not go together (named).
    """
    from ..common.config import WorkerConfig
    from ..common.flags import fields_from, options_of
    from ..default_model import DEFAULT_MODEL_NAME, default_model_dir, find_default_gguf
    from ..http import ServerConfig, build_config, read_api_key

    values = vars(args)
    command = ServeCommand(**fields_from(options_of(ServeCommand), values))
    model = args.model
    if model is None:  # the built-in model: its GGUF file kept quantized, else the converted dir
        model = str(
            find_default_gguf() if args.quantization == "gguf" else default_model_dir(in_child=True)
        )
    worker = WorkerConfig(model, **fields_from(options_of(WorkerConfig), values))
    server = {o.flag.dest for o in ServerConfig.options()}
    flags = {dest: value for dest, value in values.items() if dest in server}
    if command.no_engine_restart:
        flags["max_engine_restarts"] = 0
    config = build_config(
        worker=worker,
        served_model_name=command.served_model_name
        or (DEFAULT_MODEL_NAME if args.model is None else args.model),
        api_key=read_api_key(command.api_key, command.api_key_file, os.environ),
        headless=command.headless,
        **flags,
    )
    return command, config


def serve_main(args: argparse.Namespace) -> int:
    """Serve (or, with --headless, run this node's ranks) until stopped; the exit status."""
    from ..common.node_token import NODE_TOKEN_ENV, link_key, read_node_token

    command, config = serve_config(args)
    engine = config.llm.engine
    token = None
    if engine.nnodes > 1:  # the node link's secret: refused here, before anything starts
        token = read_node_token(command.node_token, command.node_token_file, os.environ)
        link_key(engine.nnodes, token, insecure=engine.insecure_node_link)
    if command.headless:  # a node agent runs ranks: it loads the engine's code, the API never does
        from ..engine.core import NodeAgentError, run_node_agent

        try:
            return run_node_agent(engine, node_token=token)
        except NodeAgentError as exc:
            print(f"trillm serve: {exc}", file=sys.stderr)
            return 1
    if token is not None:  # the engine process inherits it (not on its command line)
        os.environ[NODE_TOKEN_ENV] = token.decode()
    raise_open_files_limit()
    if command.max_api_restarts == 0:  # unsupervised: the API server runs in this process
        return run_api_server(config)
    from ._supervisor import supervise

    return supervise(
        config,
        run_api_server,
        max_restarts=command.max_api_restarts,
        window=command.api_restart_window,
    )


def run_api_server(config: ServerConfig) -> int:
    """The API server until it stops: 0, or 1 for a failure it reports on stderr (the engine
    did not start, or died past its restarts). Anything else is raised: a crash."""
    import trio

    from ..http import run_server

    try:
        trio.run(run_server, config)
    except Exception as exc:
        if isinstance(exc, reported_errors()):
            print(f"trillm serve: {exc}", file=sys.stderr)
            return 1
        raise
    return 0


def reported_errors() -> tuple[type[Exception], ...]:
    """The failures `trillm serve` reports in one line and exits 1 for (no traceback)."""
    from ..engine.client import EngineDeadError, EngineStartError
    from ..transport_shm import SharedMemorySpaceError, SharedMemoryUnavailableError

    return (
        EngineStartError,
        EngineDeadError,
        ValueError,
        SharedMemorySpaceError,  # /dev/shm too small: the message says how to grow it
        SharedMemoryUnavailableError,  # /dev/shm missing or read-only: how to mount one
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trillm` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:
        return bench_serve_main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "serve":
        try:
            return serve_main(args)
        except Exception as exc:
            if isinstance(exc, reported_errors()):
                print(f"trillm serve: {exc}", file=sys.stderr)
                return 1
            raise
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits
