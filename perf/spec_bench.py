"""Speculative decoding (issue 31): n-gram drafts against none, on the default model.

The default model (SmolLM2-135M-Instruct, float32, CPU) served twice side by side, without
speculation (`off`) and with `--speculative-config '{"method": "ngram", ...}'` (`ngram`),
measured interleaved (off, ngram; ngram, off; ...), medians over `--repeats`:

- copy: chat prompts asking to repeat, or lightly edit, a 300-token passage (cut from
  docs/design.md), 200 output tokens (ignore_eos), greedy, one request at a time (c=1):
  median TPOT of each server and their ratio (goal: ngram <= 0.55x off), the acceptance rate
  (accepted over verified drafts, from /metrics' `vllm:spec_decode_*` counters) and the
  tokens per engine step.
- random: `bench_serve.py --dataset random` at c=32 (token-id prompts), with the default
  `disable_by_batch_size`: output tokens per second and the ratio (goal: ngram >= 0.95x).
- identity: every prompt of both workloads gives the same greedy text on both servers.
- The engines run `--threads` compute threads (OMP_NUM_THREADS, 1 by default): on a shared
  machine a thread of a barrier-synchronised step that loses its core stalls the others, so
  two threads measure the neighbours' load more than the step.
- Each repeat has prompts of its own (other passages, another random seed), so no run hits
  the prefix cache a former run filled.
- `--sweep`: a third server that always speculates (`disable_by_batch_size` 4096) against
  `off` on the copy workload, one wave of c requests at c = 1, 2, 4, 8, 16, 32 (output tokens
  per second, one run each): where
  speculation stops paying sets `DEFAULT_DISABLE_BY_BATCH_SIZE` (`trillm.common.speculative`).
- `--verify`: no server; the real scheduler and runner in process, one thread, CPU time per
  verify step (rows x (k + 1) tokens) on each path: the C step a row per token
  (`store_first`) and the torch forward with oneDNN's linears (`_forward.VERIFY_C_STEP_MAX`).

    .venv/bin/python perf/spec_bench.py [--repeats 3] [--sweep] [--verify] \
        [--json perf/results/spec_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench_serve siblings

import bench_serve
import httpx
from _bench_cli import parse_args
from _bench_client import ClientConfig
from _bench_datasets import SampleRequest, load_tokenizer
from dp_bench import Server, Setup, serving

ROOT = Path(__file__).resolve().parent.parent
K = 4  # num_speculative_tokens
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}  # fmt: skip
PASSAGE_TOKENS, COPY_OUTPUT = 300, 200
ASKS = (
    "Repeat the following text exactly, word for word.\n\n{}",
    "Copy the following text, writing 'trillm' as 'TRILLM' and changing nothing else.\n\n{}",
)
_SPEC = re.compile(r"^trillm:spec_decode_(num_draft_tokens|num_accepted_tokens)_total\{.*\} (\S+)$")
_STEPS = re.compile(r"^trillm:engine_steps_total\{.*\} (\S+)$")


def passages(tokenizer: Any, count: int) -> list[str]:
    """`count` passages of PASSAGE_TOKENS tokens of the docs' prose (docs/*.md, the READMEs),
    in order."""
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "perf" / "README.md"]
    text = "\n\n".join(p.read_text() for p in files)
    prose = [p for p in text.split("\n\n") if not p.lstrip().startswith(("|", "```", "#"))]
    out: list[str] = []
    ids: list[int] = []
    for paragraph in prose:
        ids += tokenizer.encode(paragraph + "\n\n", add_special_tokens=False)
        while len(ids) >= PASSAGE_TOKENS:
            out.append(tokenizer.decode(ids[:PASSAGE_TOKENS]))
            ids = ids[PASSAGE_TOKENS:]
            if len(out) == count:
                return out
    raise ValueError(f"docs/*.md have prose for {len(out)} passages, not {count}")


def copy_samples(
    pool: Iterator[str], count: int, output_len: int, sets: int = 1
) -> list[list[SampleRequest]]:
    """`sets` lists of `count` copy prompts of passages taken from `pool`: no passage twice
    in a run of the bench, so none hits the prefix cache."""
    found = [next(pool) for _ in range(count * sets)]
    samples = [
        SampleRequest(ASKS[i % len(ASKS)].format(p), PASSAGE_TOKENS, output_len)
        for i, p in enumerate(found)
    ]
    return [samples[i * count : (i + 1) * count] for i in range(sets)]


def scrape(base: str) -> dict[str, float]:
    """The engine's drafts verified and accepted, and its steps, from /metrics."""
    found: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if match := _SPEC.match(line):
            found[match.group(1)] = float(match.group(2))
        elif match := _STEPS.match(line):
            found["steps"] = float(match.group(1))
    return found


def run(
    server: Server, samples: list[SampleRequest], concurrency: int, endpoint: str
) -> dict[str, Any]:
    """One measured run of `samples` at `concurrency`: bench_serve's figures, the texts, the
    acceptance rate and tokens per step of the run."""
    args = parse_args(["--num-prompts", str(len(samples)), "--max-concurrency", str(concurrency),
                       "--num-warmups", "0", "--ignore-eos"])  # fmt: skip
    config = ClientConfig(server.base_url, server.model, endpoint, ignore_eos=True)
    before = scrape(server.base_url)
    result = asyncio.run(bench_serve.benchmark(config, args, samples, None))
    after = scrape(server.base_url)
    m = result["metrics"]
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    steps = after.get("steps", 0) - before.get("steps", 0)
    return {
        "median_tpot_ms": m["median_tpot_ms"],
        "output_throughput": m["output_throughput"],
        "failed": m["failed"],
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": m["total_output_tokens"] / steps if steps else None,
        "texts": [o.generated_text for o in result["outputs"]],
    }


def interleaved(servers: list[Server], sets: list[list[SampleRequest]], concurrency: int,
                endpoint: str) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """A run of each of `sets` on each server, the order turned each round."""
    runs: dict[str, list[dict[str, Any]]] = {s.setup.name: [] for s in servers}
    for i, samples in enumerate(sets):
        for server in servers if i % 2 == 0 else servers[::-1]:
            runs[server.setup.name].append(run(server, samples, concurrency, endpoint))
            print(f"  {server.setup.name} c={concurrency} run {i + 1}: "
                  f"{_brief(runs[server.setup.name][-1])}", flush=True)  # fmt: skip
    return runs


def _brief(r: dict[str, Any]) -> str:
    rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
    return (f"TPOT {r['median_tpot_ms']:.1f} ms, {r['output_throughput']:.1f} tok/s, "
            f"acceptance {rate}, failed {r['failed']}, load {os.getloadavg()[0]:.1f}")  # fmt: skip


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def identical(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> tuple[int, int]:
    """(prompts whose texts are equal on `a` and `b`, prompts), over every run."""
    pairs = [
        (x, y)
        for ra, rb in zip(runs[a], runs[b], strict=True)
        for x, y in zip(ra["texts"], rb["texts"], strict=True)
    ]
    return sum(x == y for x, y in pairs), len(pairs)


def serve(args: argparse.Namespace) -> dict[str, Any]:
    from trillm.default_model import default_model_dir

    model = str(default_model_dir())
    tokenizer = load_tokenizer(model)
    base = ("--dtype", "float32")
    spec = ("--speculative-config", json.dumps(NGRAM))
    env = {"OMP_NUM_THREADS": str(args.threads)}
    setups = [Setup("off", 1, (model, *base), env), Setup("ngram", 1, (model, *base, *spec), env)]
    if args.sweep:
        always = ("--speculative-config", json.dumps(NGRAM | {"disable_by_batch_size": 4096}))
        setups.append(Setup("always", 1, (model, *base, *always), env))
    report: dict[str, Any] = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as logs, serving(setups, Path(logs)) as servers:
        by_name = {s.setup.name: s for s in servers}
        pair = [by_name["off"], by_name["ngram"]]
        sweep = (1, 2, 4, 8, 16, 32) if args.sweep else ()
        pool = iter(passages(tokenizer, 1 + args.copy_prompts * args.repeats + sum(sweep)))
        (warm,) = copy_samples(pool, 1, 8)
        for server in servers:
            run(server, warm, 1, "chat")  # each server's first request, unmeasured
        print("copy workload, c=1", flush=True)
        sets = copy_samples(pool, args.copy_prompts, COPY_OUTPUT, args.repeats)
        copy = interleaved(pair, sets, 1, "chat")
        report["copy"] = _summary(copy) | {"identical": identical(copy, "off", "ngram")}
        save(args, report)
        print("random dataset, c=32", flush=True)
        rand = interleaved(pair, [random_samples(args, tokenizer, seed) for seed in
                                  range(args.repeats)], 32, "completions")  # fmt: skip
        report["random"] = _summary(rand) | {"identical": identical(rand, "off", "ngram")}
        save(args, report)
        if args.sweep:  # one wave of c requests: every one admitted at the start
            report["sweep"] = {}
            for c in sweep:
                sets = copy_samples(pool, c, args.sweep_output_len)
                runs = interleaved([by_name["off"], by_name["always"]], sets, c, "chat")
                report["sweep"][c] = _summary(runs, "always")
                save(args, report)
    report["load_after"] = os.getloadavg()
    return report


def random_samples(args: argparse.Namespace, tokenizer: Any, seed: int) -> list[SampleRequest]:
    """bench_serve's random dataset, token ids (a new seed each run: no prefix-cache hits)."""
    return bench_serve.build_samples(
        parse_args(["--dataset", "random", "--prompt-format", "ids",
                    "--random-input-len", str(args.random_input_len),
                    "--random-output-len", str(args.random_output_len),
                    "--num-prompts", str(args.random_prompts), "--seed", str(seed)]),
        tokenizer,
    )  # fmt: skip


def save(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Write the report so far (a failure later keeps what was measured)."""
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def _summary(runs: dict[str, list[dict[str, Any]]], spec: str = "ngram") -> dict[str, Any]:
    out: dict[str, Any] = {
        name: {key: median(rs, key) for key in ("median_tpot_ms", "output_throughput",
                                               "acceptance_rate", "tokens_per_step")}
        for name, rs in runs.items()
    }  # fmt: skip
    out["tpot_ratio"] = out[spec]["median_tpot_ms"] / out["off"]["median_tpot_ms"]
    out["throughput_ratio"] = out[spec]["output_throughput"] / out["off"]["output_throughput"]
    out["failed"] = sum(r["failed"] for rs in runs.values() for r in rs)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-prompts", type=int, default=6)
    p.add_argument("--random-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="the engines' OMP_NUM_THREADS")
    p.add_argument("--sweep", action="store_true", help="c=1..32, always speculating")
    p.add_argument("--sweep-output-len", type=int, default=64)
    p.add_argument("--verify", action="store_true", help="only the in-process verify part")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.verify:
        from _spec_verify import verify_paths

        report = {"verify": verify_paths(), "load": os.getloadavg()}
    else:
        report = serve(args)
    print(json.dumps(report, indent=1))
    save(args, report)
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    raise SystemExit(code)
