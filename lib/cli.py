"""The `trillm` command line: `trillm serve [MODEL] [flags]`, flags named like `vllm serve`."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__


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
    serve.add_argument("model", nargs="?", help="model directory or .gguf file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="the model name clients use (default: MODEL)")
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    serve.add_argument(
        "--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"]
    )
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument(
        "--kv-cache-memory-bytes", type=int, default=1 << 30, help="the KV cache budget on CPU"
    )
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--api-key", default=os.environ.get("TRILLM_API_KEY"))
    serve.add_argument("--max-queued-requests", type=int, default=1024)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0)
    serve.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per streamed chunk (at least)"
    )
    serve.add_argument(
        "--executor",
        default="auto",
        choices=["auto", "uni", "multiproc", "null"],
        help="null: no model, deterministic tokens (for host-overhead benchmarks)",
    )
    serve.add_argument(
        "--null-step-time", type=float, default=0.0, help="the null executor's step time, s"
    )
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

    perf = Path(__file__).resolve().parent.parent / "perf"
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


def serve_main(args: argparse.Namespace) -> int:
    import trio

    from .gpu import WorkerConfig
    from .gpu._default_model import DEFAULT_MODEL_NAME, default_model_dir
    from .http._server import build_config, run_server

    model = args.model or str(default_model_dir())
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
    worker = WorkerConfig(
        model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
    )
    config = build_config(
        host=args.host,
        port=args.port,
        served_model_name=name,
        worker=worker,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        executor=args.executor,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        shutdown_timeout=args.shutdown_timeout,
        stream_interval=args.stream_interval,
        null_step_time=args.null_step_time,
    )
    trio.run(run_server, config)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trillm` console script."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:
        return bench_serve_main(argv[2:])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "serve":
        try:
            return serve_main(args)
        except Exception as exc:
            from .engine import EngineStartError

            if isinstance(exc, EngineStartError | ValueError):
                print(f"trillm serve: {exc}", file=sys.stderr)
                return 1
            raise
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits


if __name__ == "__main__":
    sys.exit(main())
