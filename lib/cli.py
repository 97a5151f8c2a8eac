"""The `trillm` command line: `trillm serve [MODEL] [flags]`, flags named like `vllm serve`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from . import __version__

if TYPE_CHECKING:
    from .http import ServerConfig


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
    serve.add_argument(
        "--cpu-linear",
        default="auto",
        choices=["auto", "onednn", "aten"],
        help="CPU linear kernels: auto (oneDNN where this CPU runs the dtype, else F.linear), "
        "onednn (or fail at load), aten (F.linear)",
    )
    serve.add_argument(
        "--quantization",
        "-q",
        default="auto",
        choices=["auto", "gguf", "none"],
        help="gguf: keep a GGUF file's Q4_0/Q4_1/Q8_0 weights quantized in memory (int4 and "
        "float16 CPU kernels, bfloat16 activations for int4); none: dequantise them to --dtype; "
        "auto: gguf for a GGUF file on the CPU, else none. With no MODEL, gguf serves the "
        "built-in model's GGUF file, auto and none its float32 conversion",
    )
    serve.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="paged attention: auto (triton on CUDA, torch on CPU), torch (SDPA reference), "
        "triton (the paged kernel; on CPU through Triton's interpreter, for correctness only)",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs, and on the CPU no C decode step: decode steps run the torch "
        "forward eagerly",
    )
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine processes, each with its own scheduler and KV cache (and TP group); "
        "requests go by load, with prefix affinity",
    )
    nodes = serve.add_argument_group(
        "multi-node tensor parallelism",
        "TP across --nnodes machines, TP / nnodes ranks each: node 0 runs the server, the "
        "engine and ranks 0..L-1; node k runs `trillm serve MODEL --headless --node-rank k` "
        "with the same flags. Collectives meet at --master-addr:--master-port (torch."
        "distributed), the engine's broadcast at --master-port + 1. Both carry prompts and "
        "activations in clear: keep them on a private network or a tunnel (WireGuard, "
        "ssh -L; docs/deploy.md). Nodes join the broadcast only with a shared node token "
        "(--node-token-file or TRILLM_NODE_TOKEN).",
    )
    nodes.add_argument("--nnodes", type=int, default=1, help="machines in the TP group")
    nodes.add_argument("--node-rank", type=int, default=0, help="this machine's index (0: server)")
    nodes.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    nodes.add_argument(
        "--master-port",
        type=int,
        help="node 0's port for torch.distributed (and +1 for the step broadcast); required "
        "with --nnodes > 1 (default: a free port)",
    )
    nodes.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's worker ranks (no server, no engine): nodes with --node-rank > 0",
    )
    nodes.add_argument(
        "--node-token-file",
        metavar="FILE",
        help="a file holding the secret every node shares (e.g. `openssl rand -hex 32 > FILE; "
        "chmod 600 FILE`): a node joins the broadcast only by proving it (HMAC-SHA256 over a "
        "fresh challenge). Or set TRILLM_NODE_TOKEN. Required with --nnodes > 1 unless "
        "--insecure-node-link",
    )
    nodes.add_argument(
        "--node-token",
        metavar="TOKEN",
        help="the node token itself; visible to every user in `ps`: prefer --node-token-file "
        "or TRILLM_NODE_TOKEN",
    )
    nodes.add_argument(
        "--insecure-node-link",
        action="store_true",
        help="let nodes join without a node token: anyone who reaches --master-port + 1 can "
        "then join as a node and read every prompt (only on a network that no one else "
        "reaches)",
    )
    nodes.add_argument(
        "--distributed-timeout",
        type=float,
        default=120.0,
        help="seconds for every node to join before start-up fails",
    )
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
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every route but /health; visible to every "
        "user in `ps`: prefer --api-key-file or TRILLM_API_KEY",
    )
    serve.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="a file (mode 0600) whose first line is the API key; or set TRILLM_API_KEY",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="completions admitted and not finished, each prompt x n counted; beyond: 429",
    )
    serve.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=1024,
        help="prompts x n in one request (a completions batch); beyond: 400",
    )
    serve.add_argument(
        "--request-body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive; then 408 and the connection is "
        "closed (0: no limit)",
    )
    serve.add_argument("--shutdown-timeout", type=float, default=30.0)
    serve.add_argument(
        "--write-timeout",
        type=float,
        default=30.0,
        help="seconds a response write may wait for a client that stopped reading; then the "
        "request is aborted",
    )
    serve.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per streamed chunk (at least)"
    )
    serve.add_argument(
        "--engine-death-grace",
        type=float,
        default=5.0,
        help="seconds the server answers 503 after the engine died, then exits non-zero",
    )
    serve.add_argument(
        "--max-engine-restarts",
        type=int,
        default=3,
        help="start a dead engine again at most this often within --engine-restart-window "
        "(its open requests resume on it; new ones wait for it); past that, exit 1 as without",
    )
    serve.add_argument("--engine-restart-window", type=float, default=300.0, help="seconds")
    serve.add_argument(
        "--max-api-restarts",
        type=int,
        default=3,
        help="run the API server in a child process and start it again, at most this often "
        "within --api-restart-window, if it crashes (a signal, an uncaught exception; its open "
        "requests are lost); 0: no child, the API server runs in this process",
    )
    serve.add_argument("--api-restart-window", type=float, default=300.0, help="seconds")
    serve.add_argument(
        "--engine-restart-wait",
        type=float,
        default=30.0,
        help="seconds a request arriving while the engine restarts waits for it; past that it "
        "gets 503 with Retry-After",
    )
    serve.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core on a thread of the API server's process (vLLM's "
        "InprocClient), for debugging: one py-spy dump shows everything; no watchdog",
    )
    serve.add_argument(
        "--no-engine-restart",
        action="store_true",
        help="never start a dead engine again: answer 503 and exit after --engine-death-grace",
    )
    serve.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="keep answering 503 after the engine died instead of exiting",
    )
    serve.add_argument(
        "--engine-watchdog-timeout",
        type=float,
        default=30.0,
        help="seconds without the engine's heartbeat (a stopped or frozen engine) before it is "
        "declared dead and killed; 0 turns the watchdog off",
    )
    serve.add_argument(
        "--structured-outputs-timeout",
        type=float,
        default=10.0,
        help="seconds a grammar (JSON schema, regex, tools) may take to compile; past it only "
        "that request fails (400)",
    )
    serve.add_argument(
        "--structured-outputs-max-depth",
        type=int,
        default=512,
        help="how deep a request's JSON schema (objects on one path, $refs followed) or grammar "
        "(rules on one chain of references) may nest; deeper is a 400, before the compiler "
        "sees it (a chain of thousands overflows its stack)",
    )
    serve.add_argument(
        "--structured-outputs-max-bytes",
        type=int,
        default=256 * 1024,
        help="the largest JSON schema, regex or grammar a request may send; larger is a 400",
    )
    serve.add_argument(
        "--structured-outputs-max-regex-optionals",
        type=int,
        default=1000,
        help="the most optional items (? or *) one regex or grammar terminal may hold; more is "
        "a 400 (their compile time grows with the square of their number)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": the model chooses between text and tool calls',
    )
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the "
        "prefix cache); off, it is null: the count tells a client what others sent before",
    )
    serve.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes", "llama3_json"],
        help="the tool-call format: hermes (<tool_call>{...}</tool_call>) or llama3_json",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        help="split <think>...</think> off into message.reasoning",
    )
    serve.add_argument("--chat-template", help="a Jinja chat template file to use instead")
    # Test hook (hidden): "forward:RANK:STEP" raises InjectedFault in that rank's forward pass
    # at that step; "token:RANK:ID" in every step whose input holds token ID.
    serve.add_argument("--inject-fault", help=argparse.SUPPRESS)
    serve.add_argument(
        "--executor",
        default="auto",
        choices=["auto", "uni", "multiproc", "null"],
        help="null: no model, deterministic tokens (for host-overhead benchmarks)",
    )
    serve.add_argument(
        "--null-step-time", type=float, default=0.0, help="the null executor's step time, s"
    )
    dev = serve.add_argument_group("control endpoints (development; docs/debugging.md)")
    dev.add_argument(
        "--enable-dev-endpoints",
        action="store_true",
        help="serve POST /sleep, /wake_up, /pause, /resume, /reset_prefix_cache, "
        "/start_profile, /stop_profile and GET /is_sleeping, /is_paused (vLLM's "
        "VLLM_SERVER_DEV_MODE); behind --api-key when set",
    )
    dev.add_argument(
        "--profiler-dir", help="where POST /start_profile's torch profiler traces are written"
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


def serve_main(args: argparse.Namespace) -> int:
    from .config import WorkerConfig
    from .default_model import DEFAULT_MODEL_NAME, default_model_dir, find_default_gguf
    from .http import build_config, read_api_key

    model = args.model
    if model is None:  # the built-in model: its GGUF file kept quantized, else the converted dir
        model = str(
            find_default_gguf() if args.quantization == "gguf" else default_model_dir(in_child=True)
        )
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
    worker = WorkerConfig(
        model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        cpu_linear=args.cpu_linear,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        inject_fault=args.inject_fault,
    )
    config = build_config(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        headless=args.headless,
        distributed_timeout=args.distributed_timeout,
        host=args.host,
        port=args.port,
        served_model_name=name,
        worker=worker,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        executor=args.executor,
        api_key=read_api_key(args.api_key, args.api_key_file, os.environ),
        max_queued_requests=args.max_queued_requests,
        max_prompts_per_request=args.max_prompts_per_request,
        request_body_timeout=args.request_body_timeout,
        shutdown_timeout=args.shutdown_timeout,
        write_timeout=args.write_timeout,
        stream_interval=args.stream_interval,
        null_step_time=args.null_step_time,
        engine_death_grace=args.engine_death_grace,
        keep_alive_on_engine_death=args.keep_alive_on_engine_death,
        engine_watchdog_timeout=args.engine_watchdog_timeout,
        max_engine_restarts=0 if args.no_engine_restart else args.max_engine_restarts,
        engine_restart_window=args.engine_restart_window,
        engine_restart_wait=args.engine_restart_wait,
        engine_in_process=args.engine_in_process,
        structured_outputs_timeout=args.structured_outputs_timeout,
        structured_outputs_max_depth=args.structured_outputs_max_depth,
        structured_outputs_max_bytes=args.structured_outputs_max_bytes,
        structured_outputs_max_regex_optionals=args.structured_outputs_max_regex_optionals,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template,
        enable_dev_endpoints=args.enable_dev_endpoints,
        profiler_dir=args.profiler_dir,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    from .engine.protocol import NODE_TOKEN_ENV, link_key, read_node_token

    token = None
    if args.nnodes > 1:  # the node link's secret: refused here, before anything starts
        token = read_node_token(args.node_token, args.node_token_file, os.environ)
        link_key(args.nnodes, token, insecure=args.insecure_node_link)
    if args.insecure_node_link:
        import dataclasses

        import msgspec

        engine = msgspec.structs.replace(config.llm.engine, insecure_node_link=True)
        config = dataclasses.replace(config, llm=dataclasses.replace(config.llm, engine=engine))
    if args.headless:  # a node agent runs ranks: it loads the engine's code, the API never does
        from .engine.core import NodeAgentError, run_node_agent

        try:
            return run_node_agent(config.llm.engine, node_token=token)
        except NodeAgentError as exc:
            print(f"trillm serve: {exc}", file=sys.stderr)
            return 1
    if token is not None:  # the engine process inherits it (not on its command line)
        os.environ[NODE_TOKEN_ENV] = token.decode()
    raise_open_files_limit()
    if args.max_api_restarts == 0:  # unsupervised: the API server runs in this process
        return run_api_server(config)
    from .http import supervise

    return supervise(
        config, run_api_server, max_restarts=args.max_api_restarts, window=args.api_restart_window
    )


def run_api_server(config: ServerConfig) -> int:
    """The API server until it stops: 0, or 1 for a failure it reports on stderr (the engine
    did not start, or died past its restarts). Anything else is raised: a crash."""
    import trio

    from .http import run_server

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
    from .engine.client import EngineDeadError, EngineStartError

    return (EngineStartError, EngineDeadError, ValueError)


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
            if isinstance(exc, reported_errors()):
                print(f"trillm serve: {exc}", file=sys.stderr)
                return 1
            raise
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits


if __name__ == "__main__":
    sys.exit(main())
