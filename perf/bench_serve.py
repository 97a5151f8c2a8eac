"""Latency benchmark of any OpenAI-compatible server, like `vllm bench serve`.

Streams requests (random token ids, ShareGPT or shared-prefix prompts) at a given arrival
rate and concurrency, and reports TTFT, TPOT, ITL and E2EL percentiles, throughput and
goodput; the JSON output uses vLLM's key names, so the two tools' results compare directly.
The client process's own CPU time is measured too: a client above ~80% of one core is part
of what it measures, and the report says so.

    python perf/bench_serve.py --base-url http://127.0.0.1:8000 --dataset random \
        --random-input-len 512 --random-output-len 128 --num-prompts 200 \
        --request-rate 8 --max-concurrency 32 --ignore-eos --save-result out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _bench_* siblings

import httpx
import numpy as np
from _bench_cli import parse_args
from _bench_client import ClientConfig, arrival_delays, open_client, run_requests
from _bench_datasets import (
    DatasetError,
    SampleRequest,
    load_tokenizer,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from _bench_metrics import (
    compute_metrics,
    parse_goodput,
    per_request_arrays,
)
from _bench_plot import PlotUnavailableError, require_matplotlib, save_plot
from _bench_tokenizer import TokenizerNotFoundError, find_tokenizer, served_models

CPU_WARNING_FRACTION = 0.8


def first_model(base_url: str, api_key: str | None) -> str:
    """The first model id the server lists, the default for `--model`."""
    cards = served_models(base_url, api_key)
    if not cards:
        raise ValueError(f"the server at {base_url} lists no models: pass --model NAME")
    return str(cards[0]["id"])


def build_samples(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The dataset's prompts; random kinds need the tokenizer to count exact token ids.

    `tokenizer` may be None only for sharegpt (the server's usage then counts the prompts).
    """
    rng = np.random.default_rng(args.seed)
    as_text = args.endpoint == "chat" or args.prompt_format == "text"
    total = args.num_prompts + args.num_warmups
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise DatasetError("--dataset sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(
            args.dataset_path, total, tokenizer, rng, output_len=args.sharegpt_output_len
        )
    if args.dataset == "random":
        return random_requests(
            tokenizer, total, args.random_input_len, args.random_output_len,
            args.random_range_ratio, rng, as_text=as_text,
        )  # fmt: skip
    return prefix_repetition_requests(
        tokenizer, total, args.prefix_len, args.num_prefixes, args.random_input_len,
        args.random_output_len, args.random_range_ratio, rng, as_text=as_text,
    )  # fmt: skip


async def benchmark(
    config: ClientConfig, args: argparse.Namespace, samples: list[SampleRequest], tokenizer: Any
) -> dict[str, Any]:
    """Warm-ups (unmeasured), then the measured run; the report and per-request arrays."""
    count = None if tokenizer is None else (lambda t: len(tokenizer.encode(t)))
    warmups, measured = samples[: args.num_warmups], samples[args.num_warmups :]
    async with open_client(config) as client:
        if warmups:
            await run_requests(
                client, config, warmups, np.zeros(len(warmups)), args.max_concurrency, count,
                show_progress=False,
            )  # fmt: skip
        delays = arrival_delays(len(measured), args.request_rate, args.burstiness, args.seed)
        cpu0 = time.process_time()
        outputs, duration = await run_requests(
            client, config, measured, delays, args.max_concurrency, count
        )
        cpu = time.process_time() - cpu0
    result = compute_metrics(outputs, duration, parse_goodput(args.goodput or []))
    result |= {
        "client_cpu_fraction": cpu / max(duration, 1e-9),
        "client_cpu_ms_per_request": cpu * 1e3 / max(len(outputs), 1),
    }
    return {"metrics": result, "outputs": outputs}


def print_report(config: ClientConfig, m: dict[str, Any]) -> None:
    """The console table, in vLLM's layout."""
    line = "=" * 60

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{name:<44}{text:>16}")

    print(f"{' Serving Benchmark Result ':=^60}")
    print(f"Endpoint: {config.url}\nModel: {config.model}")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Output tokens per request (mean):", m["mean_output_len"])
    row("Output tokens per request (min / max):", f"{m['min_output_len']} / {m['max_output_len']}")
    row("Requests short of max_tokens:", m["num_short_outputs"])
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row("Client CPU (fraction of one core):", m["client_cpu_fraction"])
    row("Client CPU per request (ms):", m["client_cpu_ms_per_request"])
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for key, title in titles.items():
        print(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {key.upper()} (ms):", m[f"{stat}_{key}_ms"])
    print(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.plot is not None:
            require_matplotlib()
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        model = args.model or first_model(args.base_url, api_key)
        tokenizer_path = args.tokenizer or find_tokenizer(model, args.base_url, api_key)
        if tokenizer_path is None and args.dataset != "sharegpt":
            raise TokenizerNotFoundError(args.dataset, model, args.base_url)
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
        samples = build_samples(args, tokenizer)
    except (PlotUnavailableError, DatasetError, ValueError, OSError, httpx.HTTPError) as e:
        print(f"bench_serve: {e}", file=sys.stderr)
        return 2
    config = ClientConfig(
        args.base_url, model, args.endpoint, args.ignore_eos, api_key, args.request_timeout
    )
    print(f"{len(samples) - args.num_warmups} requests to {config.url}, rate {args.request_rate}")
    run = asyncio.run(benchmark(config, args, samples, tokenizer))
    m, outputs = run["metrics"], run["outputs"]
    print_report(config, m)
    for i, o in enumerate(outputs):
        if o.error:
            print(f"request {i} failed: {o.error}")
    if m["client_cpu_fraction"] > CPU_WARNING_FRACTION:
        print(
            f"WARNING: the client used {m['client_cpu_fraction']:.0%} of one core: it may be the "
            "bottleneck; lower --max-concurrency or run more client processes",
            file=sys.stderr,
        )
    if args.save_result:
        report = {"model": model, "endpoint": args.endpoint, "dataset": args.dataset}
        report |= m | per_request_arrays(outputs)
        Path(args.save_result).write_text(json.dumps(report, indent=1))
    if args.plot:
        save_plot(outputs, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
