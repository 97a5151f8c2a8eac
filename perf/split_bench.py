"""Host cost per token: the engine in process (a thread) against split (its own process).

The seed's prediction: at batch 1 the two are near-identical (the host work per step is small
next to the step), and the gap opens with the batch: in process, the frontend's per-token work
(the output pump, detokenising, mailboxes) and the engine's (scheduling, the STEP record)
share one GIL, so they add up; split, they overlap on two cores.

Both `AsyncLLM`s (the null executor: no model, tokens after a fixed `--step-time`; SmolLM2's
tokenizer detokenises them) run in this one trio program; each batch size is measured on both,
interleaved, `--repeats` times. Reported per (mode, B): streamed tokens/s, the achieved step
period against the fixed one, and CPU microseconds per token of all the work (this process,
plus the engine process when split), as medians.

    python perf/split_bench.py [--batches 1,16,64,256] [--step-time 0.005] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import trio
from host_overhead import cpu_seconds  # perf/ is scripts: the one next to this

from trillm.default_model import default_model_dir
from trillm.engine import AsyncLLM, EngineConfig, LLMConfig, SamplingParams, open_llm
from trillm.gpu import WorkerConfig


def config(model: str, step_time: float, in_process: bool) -> LLMConfig:
    worker = WorkerConfig(model, device="cpu", max_num_seqs=512, max_num_batched_tokens=16384)
    engine = EngineConfig(worker=worker, executor="null", null_step_time=step_time)  # type: ignore[arg-type]
    return LLMConfig(engine, in_process=in_process)


async def run_batch(llm: AsyncLLM, batch: int, max_tokens: int) -> tuple[int, float]:
    """(tokens streamed, wall seconds) of `batch` concurrent streams."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    counts: list[int] = []

    async def one(i: int) -> None:
        n = 0
        async with llm.generate([100 + (i + j) % 500 for j in range(16)], params) as stream:
            async for out in stream:
                n += len(out.token_ids)
        counts.append(n)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(batch):
            nursery.start_soon(one, i)
    return sum(counts), time.perf_counter() - started


async def measure(llm: AsyncLLM, batch: int, max_tokens: int, step_time: float) -> dict[str, float]:
    engine = llm.engines[0]
    split = not engine.in_process
    me, child = os.getpid(), engine.process.pid
    cpu0 = cpu_seconds(me) + (cpu_seconds(child) if split else 0.0)
    tokens, wall = await run_batch(llm, batch, max_tokens)
    cpu = cpu_seconds(me) + (cpu_seconds(child) if split else 0.0) - cpu0
    steps = max_tokens  # one token per request per step, all admitted in the first
    return {
        "tokens_per_s": tokens / wall,
        "step_period_ms": wall / steps * 1e3,
        "host_us_per_token": cpu / tokens * 1e6,
        "host_us_per_token_over_step": max(0.0, wall - steps * step_time) / tokens * 1e6,
    }


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = str(default_model_dir())
    rows: list[dict[str, Any]] = []
    async with (
        open_llm(config(model, args.step_time, in_process=False)) as split,
        open_llm(config(model, args.step_time, in_process=True)) as inproc,
    ):
        llms = {"split": split, "in_process": inproc}
        for llm in llms.values():  # warm-up: tokenizer caches, allocator
            await run_batch(llm, 16, 8)
        for batch in args.batches:
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in llms}
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    samples[name].append(await measure(llm, batch, args.max_tokens, args.step_time))
            for name, runs in samples.items():
                row: dict[str, Any] = {"mode": name, "batch": batch}
                for key in runs[0]:
                    row[key] = statistics.median(r[key] for r in runs)
                rows.append(row)
                print(
                    f"{name:>11} B={batch:<4} {row['tokens_per_s']:>9.0f} tok/s  step "
                    f"{row['step_period_ms']:6.2f} ms (fixed {args.step_time * 1e3:g})  host "
                    f"{row['host_us_per_token']:7.1f} us/token CPU",
                    flush=True,
                )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256]
    )
    p.add_argument("--step-time", type=float, default=0.005)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = trio.run(bench, args)
    by = {(r["mode"], r["batch"]): r for r in rows}
    print("ratio in_process / split (step period; host us per token):")
    for batch in args.batches:
        a, b = by[("in_process", batch)], by[("split", batch)]
        print(f"  B={batch:<4} {a['step_period_ms'] / b['step_period_ms']:.2f}x; "
              f"{a['host_us_per_token'] / b['host_us_per_token']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"step_time": args.step_time, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
