"""The prefill cap (`--max-prefill-tokens-per-decode`) in process: the real scheduler driving
the real model runner, no engine process, no rings, no frontend, so the figures are the
scheduling policy's alone and every setting runs side by side in one process.

    .venv/bin/python perf/prefill_cap_bench.py [--caps 0,1,2,4] [--steps 30] [--json FILE]

Time is each step's CPU seconds (`time.process_time`, `--threads 1` by default): on a shared
machine a step's wall time is mostly other people's work, its CPU time is its own. A stream's
time per output token is then the CPU time of the steps it waits through; a request's time to
first token the CPU time of the steps from its arrival to its first token.

Two loads per cap (0 is no cap, the budget's rest, as before the cap):
- `mixed`: 4 generation streams (32-token prompts) decoding while 32 pooling requests of 128
  tokens stay queued (refilled as they end): the streams' mean time per output token, over
  the same streams alone; and the embeddings' tokens per second meanwhile.
- `gen c=32`: a closed loop of 32 clients, each request 128 prompt tokens and 64 greedy
  output tokens, a new one as one ends: time to first token (median, p90) and output tokens
  per second over `--steps`-many times 8 steps.
Caps run interleaved in rounds, medians over `--rounds`.

`--curve 0,1,2,16,128`: what a step of 4 decodes costs with that many prompt tokens beside
them (the median CPU time of 9 steps each, interleaved): the fixed cost of leaving the decode
fast path, then the cost per prompt token, which is why the cap spends its credit on whole
prompts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from trillm.common.config import WorkerConfig
from trillm.common.wire import PoolingType
from trillm.default_model import default_model_dir
from trillm.engine.core.sched._request import Request
from trillm.engine.core.sched._scheduler import Scheduler, SchedulerConfig
from trillm.gpu import ModelRunner, SamplingOptions, TensorParallel
from trillm.gpu.loader._weights import open_model

BLOCK, BUDGET = 16, 2048


def make_runner(model: str) -> tuple[ModelRunner, int]:
    config = WorkerConfig(
        model,
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        max_model_len=1024,
        max_num_batched_tokens=BUDGET,
        kv_cache_bytes=1 << 28,
    )
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
    runner.load_model(weights)
    num_blocks = 4096
    runner.init_kv_cache(num_blocks)
    return runner, num_blocks


class Loop:
    """A scheduler and the runner stepping it, as the engine's busy loop (no rings)."""

    def __init__(self, runner: ModelRunner, num_blocks: int, cap: int) -> None:
        self.runner = runner
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=BLOCK,
                max_num_seqs=256,
                max_num_batched_tokens=BUDGET,
                max_model_len=1024,
                enable_prefix_caching=False,
                max_prefill_tokens_per_decode=cap,
            )
        )
        self.rnums = itertools.count(1 << 20)
        self.rng = np.random.default_rng(0)

    def add(self, length: int, max_tokens: int, pooling: PoolingType = PoolingType.NONE) -> int:
        rnum = next(self.rnums)
        ids = self.rng.integers(100, 30000, length).tolist()
        options = SamplingOptions(temperature=0.0, ignore_eos=True, pooling=pooling)
        self.scheduler.add_request(Request(rnum, ids, options, max_tokens))
        return rnum

    def step(self) -> tuple[float, list[int], list[int]]:
        """One step: its seconds, the rnums that sampled a token, the rnums that ended."""
        batch = self.scheduler.schedule()
        start = time.process_time()
        output = self.runner.execute(batch)
        seconds = time.process_time() - start
        result = self.scheduler.update_from_output(batch, output)
        sampled = output.rnums.tolist()
        ended = [r for r, f in zip(result.rnums.tolist(), result.finish.tolist(), strict=True) if f]
        return seconds, sampled, ended

    def drain(self) -> None:
        self.scheduler.abort_requests(self.scheduler.unfinished_rnums())
        self.step()


def mixed(loop: Loop, steps: int, flood: bool) -> tuple[float, float]:
    """(mean seconds per output token of 4 streams, embedding tokens per second)."""
    streams = {loop.add(32, 10_000) for _ in range(4)}
    pooling: set[int] = set()
    while not all(loop.scheduler.requests[r].output_token_ids for r in streams):
        loop.step()  # the streams' prompts, before the clock starts
    gaps, pooled, elapsed = [], 0, 0.0
    for _ in range(steps):
        while flood and len(pooling) < 32:
            pooling.add(loop.add(128, 1, PoolingType.LAST))
        seconds, sampled, ended = loop.step()
        elapsed += seconds
        if streams & set(sampled):
            gaps.append(seconds)
        done = pooling & set(ended)
        pooled += 128 * len(done)
        pooling -= done
    loop.drain()
    return statistics.mean(gaps), pooled / elapsed


def generation(loop: Loop, steps: int) -> tuple[float, float, float]:
    """A closed loop of 32 clients (128 in, 64 out): TTFT median and p90, output tok/s."""
    added: dict[int, float] = {}
    for _ in range(32):
        added[loop.add(128, 64)] = 0.0
    ttfts, clock, tokens = [], 0.0, 0
    for i in range(steps):
        seconds, sampled, ended = loop.step()
        clock += seconds
        for rnum in sampled:
            if rnum in added:
                if i >= steps // 4:  # after the first wave's lockstep has spread out
                    ttfts.append(clock - added[rnum])
                del added[rnum]
        tokens += len(sampled)
        for _ in ended:
            added[loop.add(128, 64)] = clock
    loop.drain()
    return statistics.median(ttfts), float(np.percentile(ttfts, 90)), tokens / clock


def curve(runner: ModelRunner, num_blocks: int, sizes: list[int]) -> None:
    """Print the CPU time of a step of 4 decodes and each of `sizes` prompt tokens."""
    loop = Loop(runner, num_blocks, 0)
    streams = {loop.add(32, 10_000) for _ in range(4)}
    while not all(loop.scheduler.requests[r].output_token_ids for r in streams):
        loop.step()
    prompt = loop.add(1000, 1, PoolingType.LAST)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    scheduler = loop.scheduler
    config = scheduler.config
    for _ in range(3):
        for n in sizes:
            for _ in range(3):
                # n tokens: no cap, a budget of the 4 decodes and n; none: the cap, no credit
                scheduler.prefill_credit = 0
                request = scheduler.requests.get(prompt)
                if request is None or request.num_tokens - request.num_computed_tokens <= n:
                    prompt = loop.add(1000, 1, PoolingType.LAST)  # a fresh one, long enough
                cap, budget = (0, 4 + n) if n else (1, config.max_num_batched_tokens)
                scheduler.config = replace(
                    config, max_prefill_tokens_per_decode=cap, max_num_batched_tokens=budget
                )
                times[n].append(loop.step()[0])
        scheduler.config = config
    print("prompt tokens beside 4 decodes: CPU ms of the step")
    print("  ".join(f"{n}: {1e3 * statistics.median(t):.1f}" for n, t in times.items()))
    loop.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--caps", default="0,1,2,4")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--curve", default=None, help="prompt token counts (see above)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    runner, num_blocks = make_runner(args.model or str(default_model_dir(progress=False)))
    if args.curve:
        curve(runner, num_blocks, [int(n) for n in args.curve.split(",")])
        return
    caps = [int(c) for c in args.caps.split(",")]
    runs: dict[int, dict[str, list[float]]] = {c: {} for c in caps}
    for _ in range(args.rounds):
        for cap in caps:
            loop = Loop(runner, num_blocks, cap)
            alone, _ = mixed(loop, args.steps, flood=False)
            flooded, emb = mixed(loop, args.steps, flood=True)
            ttft, ttft90, tps = generation(loop, args.steps * 8)
            figures = {"tpot_alone": alone, "tpot_flood": flooded, "emb_tok_s": emb}
            figures |= {"ttft": ttft, "ttft_p90": ttft90, "gen_tok_s": tps}
            for key, value in figures.items():
                runs[cap].setdefault(key, []).append(value)
    base = {k: statistics.median(v) for k, v in runs[caps[0]].items()}
    table = {}
    print("cap  TPOT alone  flooded  ratio  emb tok/s | gen c=32: TTFT p50    p90    tok/s")
    for cap in caps:
        m = {k: statistics.median(v) for k, v in runs[cap].items()}
        table[cap] = m
        print(
            f"{cap:3d}  {1e3 * m['tpot_alone']:7.1f} ms {1e3 * m['tpot_flood']:6.1f} ms "
            f"{m['tpot_flood'] / m['tpot_alone']:5.2f}x {m['emb_tok_s']:8.0f}  | "
            f"{1e3 * m['ttft']:7.0f} ms ({m['ttft'] / base['ttft']:4.2f}x) "
            f"{1e3 * m['ttft_p90']:6.0f} ms {m['gen_tok_s']:6.1f} "
            f"({m['gen_tok_s'] / base['gen_tok_s']:4.2f}x)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
