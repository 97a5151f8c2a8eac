"""The command line of `bench_serve.py`, with vLLM's option names where vLLM has one."""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the options; a bad value exits with argparse's usage message."""
    p = argparse.ArgumentParser(prog="bench_serve.py", description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="default: the first id from GET /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", help="default: $OPENAI_API_KEY")
    p.add_argument(
        "--tokenizer",
        help="path (directory or .gguf) or hub id; default: the model name if it is a local "
        "directory or .gguf file, or the built-in model's when a trillm server serves it",
    )
    p.add_argument(
        "--dataset", choices=("random", "sharegpt", "prefix-repetition"), default="random"
    )
    p.add_argument("--dataset-path", type=Path, help="the ShareGPT JSON file")
    p.add_argument("--sharegpt-output-len", type=int, help="override the replies' lengths")
    p.add_argument("--random-input-len", type=int, default=1024, help="(suffix for prefixes)")
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="completions prompts as text re-encoded to the exact length (any server) or as "
        "token-id lists (vLLM, trillm)",
    )
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s or inf")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, help="default: no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos/min_tokens")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="ttft:MS tpot:MS e2el:MS")
    p.add_argument("--save-result", type=Path, metavar="PATH", help="write the JSON report")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG (needs matplotlib)")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, not {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, not {args.max_concurrency}")
    if args.request_rate <= 0 or args.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    return args
