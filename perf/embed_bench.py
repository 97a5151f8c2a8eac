"""Embeddings through the engine against the bare batched forward, and generation beside them.

    .venv/bin/python perf/embed_bench.py [--model DIR] [--requests 64] [--json FILE]

Four figures, one run, one model (default: the built-in SmolLM2-135M, float32 on the CPU):

- `forward`: the baseline: trillm's own `ModelRunner` in this process, one step of 32 pooling
  requests of 128 tokens (prefill and pooling, no engine, no rings): tokens per second.
- `transformers`: transformers' `AutoModel` forward on the same [32, 128] batch.
- `engine c=1` and `engine c=32`: `AsyncLLM.encode` through the engine process (its own
  scheduler, rings and frontend), one request at a time and 32 at once, 128-token inputs of
  random ids (no prefix hits): embeddings per second, and tokens per second over `forward`'s.
- `mixed`: 4 generation streams (greedy, 64 tokens each) alone, then the same streams while
  32 workers flood the engine with embeddings; the streams' TPOT p50 both ways and their ratio.

The forward and the engine at c=32 run interleaved, `--rounds` times (one forward step, then
`--requests` encodes), and the ratio is the median of each round's: on a shared machine the
load moves within a minute, so a forward measured before the engine is not its baseline.
Beside wall time, CPU seconds per token: the forward's (this process, around the step) and
the engine process's (its schedstat), a figure the other work on the machine moves less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import trio

from trillm.common.config import WorkerConfig
from trillm.default_model import default_model_dir
from trillm.engine.client import AsyncLLM, EngineConfig, LLMConfig, PoolingType, open_llm
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.gpu import ModelRunner, NewRequest, SamplingOptions, StepBatch, TensorParallel
from trillm.gpu.loader._weights import open_model

BATCH, LENGTH = 32, 128


def worker_config(model: str, dtype: str, cap: int | None = None) -> WorkerConfig:
    extra = {} if cap is None else {"max_prefill_tokens_per_decode": cap}
    return WorkerConfig(
        model,
        device="cpu",
        dtype=dtype,
        block_size=16,
        max_model_len=1024,
        max_num_batched_tokens=BATCH * LENGTH,
        kv_cache_bytes=1 << 28,
        **extra,  # type: ignore[arg-type]
    )


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30000, LENGTH).tolist() for _ in range(n)]


class Forward:
    """trillm's runner, in process: steps of BATCH pooling prefills of LENGTH tokens."""

    def __init__(self, model: str, dtype: str) -> None:
        config = worker_config(model, dtype)
        model_config, weights = open_model(config.model, config.load_format)
        self.runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
        self.runner.load_model(weights)
        self.blocks_per = LENGTH // config.block_size
        self.runner.init_kv_cache(BATCH * self.blocks_per)
        self.steps = 0
        self.step()  # a warm-up

    def step(self) -> tuple[float, float]:
        """One step: (tokens per second, CPU seconds per token)."""
        options = SamplingOptions(pooling=PoolingType.LAST)
        step = self.steps
        new = [
            NewRequest(
                step * BATCH + i,
                ids,
                list(range(i * self.blocks_per, (i + 1) * self.blocks_per)),
                0,
                options,
            )
            for i, ids in enumerate(prompts(BATCH, step))
        ]
        rnums = np.array([r.rnum for r in new], np.uint64)
        batch = StepBatch(
            step,
            new_requests=new,
            scheduled_rnums=rnums,
            num_scheduled_tokens=np.full(BATCH, LENGTH, np.int32),
            finished_rnums=rnums - BATCH if step else np.zeros(0, np.uint64),
        )
        self.steps += 1
        start, cpu = time.perf_counter(), time.process_time()
        output = self.runner.execute(batch)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert output.pooled is not None and output.pooled.shape[0] == BATCH
        return BATCH * LENGTH / seconds, cpu / (BATCH * LENGTH)


def cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of `pid` so far (schedstat: nanoseconds)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def engine_pids() -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def transformers_tokens_per_s(model: str, repeats: int) -> float:
    hf = transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    times = []
    for repeat in range(repeats + 1):
        ids = torch.tensor(prompts(BATCH, repeat))
        start = time.perf_counter()
        with torch.no_grad():
            hf(ids).last_hidden_state[:, -1].float().numpy()
        if repeat:
            times.append(time.perf_counter() - start)
    return BATCH * LENGTH / statistics.median(times)


async def encode_rate(llm: AsyncLLM, concurrency: int, requests: int) -> float:
    """Embeddings per second with `concurrency` workers sharing `requests` inputs."""
    todo = prompts(requests, 1000 + concurrency)

    async def worker() -> None:
        while todo:
            await llm.encode(todo.pop(), PoolingType.LAST)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return requests / (time.perf_counter() - start)


async def streams_tpot(llm: AsyncLLM, streams: int, tokens: int) -> list[float]:
    """Each stream's time per output token after the first (seconds)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    tpots: list[float] = []

    async def one(i: int) -> None:
        stamps = []
        async with llm.generate(prompts(1, 5000 + i)[0][:32], params) as stream:
            async for output in stream:
                stamps.extend([time.perf_counter()] * len(output.token_ids))
        gaps = np.diff(stamps)
        tpots.append((stamps[-1] - stamps[0]) / max(1, len(gaps)))

    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    return tpots


async def engine_figures(
    model: str, dtype: str, requests: int, forward: Forward, rounds: int, cap: int
) -> dict[str, Any]:
    worker = worker_config(model, dtype, cap)
    config = LLMConfig(EngineConfig(worker=worker), start_timeout=300)
    async with open_llm(config) as llm:
        await encode_rate(llm, 8, 16)  # warm-up
        engine = engine_pids()
        runs: dict[str, list[float]] = {}
        for _ in range(rounds):  # interleaved: each round's forward is its baseline
            forward_tok_s, forward_cpu = forward.step()
            cpu = sum(cpu_seconds(pid) for pid in engine)
            c32 = await encode_rate(llm, BATCH, requests)
            engine_cpu = (sum(cpu_seconds(pid) for pid in engine) - cpu) / (requests * LENGTH)
            c1 = await encode_rate(llm, 1, max(4, requests // 16))
            for key, value in (
                ("forward_tok_s", forward_tok_s),
                ("c32_per_s", c32),
                ("c1_per_s", c1),
                ("c32_ratio", c32 * LENGTH / forward_tok_s),
                ("c1_ratio", c1 * LENGTH / forward_tok_s),
                ("forward_cpu_per_tok", forward_cpu),
                ("engine_cpu_per_tok", engine_cpu),
            ):
                runs.setdefault(key, []).append(value)
        figures: dict[str, Any] = {k: statistics.median(v) for k, v in runs.items()}
        alone = await streams_tpot(llm, 4, 64)
        with trio.CancelScope() as flood:
            async with trio.open_nursery() as nursery:

                async def flooding() -> None:
                    while True:
                        await encode_rate(llm, BATCH, BATCH)

                nursery.start_soon(flooding)
                mixed = await streams_tpot(llm, 4, 64)
                flood.cancel()
        figures["tpot_alone_ms"] = 1e3 * statistics.median(alone)
        figures["tpot_flood_ms"] = 1e3 * statistics.median(mixed)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the built-in)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cap", type=int, default=None, help="--max-prefill-tokens-per-decode (default: its)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or str(default_model_dir(progress=False))
    forward_runner = Forward(model, args.dtype)
    reference = transformers_tokens_per_s(model, args.repeats)
    engine = trio.run(
        engine_figures, model, args.dtype, args.requests, forward_runner, args.rounds, args.cap
    )
    forward = engine["forward_tok_s"]
    c1, c32 = engine["c1_per_s"], engine["c32_per_s"]
    cpu_forward, cpu_engine = engine["forward_cpu_per_tok"], engine["engine_cpu_per_tok"]
    lines = [
        f"model {Path(model).name}, {args.dtype} on cpu, inputs of {LENGTH} tokens, "
        f"medians of {args.rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f}",
        f"forward       {forward:9.0f} tok/s  (trillm's runner in process, [{BATCH}, {LENGTH}])",
        f"transformers  {reference:9.0f} tok/s  (AutoModel, [{BATCH}, {LENGTH}])",
        f"engine c=1    {c1:9.1f} emb/s = {c1 * LENGTH:7.0f} tok/s  "
        f"{engine['c1_ratio']:5.2f}x forward",
        f"engine c=32   {c32:9.1f} emb/s = {c32 * LENGTH:7.0f} tok/s  "
        f"{engine['c32_ratio']:5.2f}x forward  {c32 * LENGTH / reference:5.2f}x transformers",
        f"CPU per token {1e3 * cpu_forward:.3f} ms forward, {1e3 * cpu_engine:.3f} ms engine "
        f"process at c=32: {cpu_engine / cpu_forward:.2f}x",
        f"mixed         TPOT p50 {engine['tpot_alone_ms']:.1f} ms alone, "
        f"{engine['tpot_flood_ms']:.1f} ms under an embeddings flood: "
        f"{engine['tpot_flood_ms'] / engine['tpot_alone_ms']:.2f}x",
    ]
    print("\n".join(lines))
    if args.json is not None:
        record = {"transformers_tok_s": reference, **engine}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
