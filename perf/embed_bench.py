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

Medians of `--repeats` runs for the forward baselines; the engine figures are over
`--requests` requests after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import trio

from trillm.config import WorkerConfig
from trillm.default_model import default_model_dir
from trillm.engine.client import AsyncLLM, EngineConfig, LLMConfig, PoolingType, open_llm
from trillm.engine.client._sampling_params import SamplingParams
from trillm.gpu import ModelRunner, NewRequest, SamplingOptions, StepBatch, TensorParallel
from trillm.gpu._weights import open_model

BATCH, LENGTH = 32, 128


def worker_config(model: str, dtype: str) -> WorkerConfig:
    return WorkerConfig(
        model,
        device="cpu",
        dtype=dtype,
        block_size=16,
        max_model_len=1024,
        max_num_batched_tokens=BATCH * LENGTH,
        kv_cache_bytes=1 << 28,
    )


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30000, LENGTH).tolist() for _ in range(n)]


def forward_tokens_per_s(model: str, dtype: str, repeats: int) -> float:
    """trillm's runner, in process: one step of BATCH pooling prefills of LENGTH tokens."""
    config = worker_config(model, dtype)
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
    runner.load_model(weights)
    blocks_per = LENGTH // config.block_size
    runner.init_kv_cache(BATCH * blocks_per)
    options = SamplingOptions(pooling=PoolingType.LAST)
    times = []
    for repeat in range(repeats + 1):
        new = [
            NewRequest(
                repeat * BATCH + i,
                ids,
                list(range(i * blocks_per, (i + 1) * blocks_per)),
                0,
                options,
            )
            for i, ids in enumerate(prompts(BATCH, repeat))
        ]
        rnums = np.array([r.rnum for r in new], np.uint64)
        batch = StepBatch(
            repeat,
            new_requests=new,
            scheduled_rnums=rnums,
            num_scheduled_tokens=np.full(BATCH, LENGTH, np.int32),
            finished_rnums=rnums - BATCH if repeat else np.zeros(0, np.uint64),
        )
        start = time.perf_counter()
        output = runner.execute(batch)
        if repeat:  # the first is a warm-up
            times.append(time.perf_counter() - start)
        assert output.pooled is not None and output.pooled.shape[0] == BATCH
    return BATCH * LENGTH / statistics.median(times)


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


async def engine_figures(model: str, dtype: str, requests: int) -> dict[str, Any]:
    config = LLMConfig(EngineConfig(worker=worker_config(model, dtype)), start_timeout=300)
    async with open_llm(config) as llm:
        await encode_rate(llm, 8, 16)  # warm-up
        figures: dict[str, Any] = {
            "c1_per_s": await encode_rate(llm, 1, max(8, requests // 4)),
            "c32_per_s": await encode_rate(llm, BATCH, requests),
        }
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
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or str(default_model_dir(progress=False))
    forward = forward_tokens_per_s(model, args.dtype, args.repeats)
    reference = transformers_tokens_per_s(model, args.repeats)
    engine = trio.run(engine_figures, model, args.dtype, args.requests)
    c1, c32 = engine["c1_per_s"], engine["c32_per_s"]
    lines = [
        f"model {Path(model).name}, {args.dtype} on cpu, inputs of {LENGTH} tokens",
        f"forward       {forward:9.0f} tok/s  (trillm's runner in process, [{BATCH}, {LENGTH}])",
        f"transformers  {reference:9.0f} tok/s  (AutoModel, [{BATCH}, {LENGTH}])",
        f"engine c=1    {c1:9.1f} emb/s = {c1 * LENGTH:7.0f} tok/s  "
        f"{c1 * LENGTH / forward:5.2f}x forward",
        f"engine c=32   {c32:9.1f} emb/s = {c32 * LENGTH:7.0f} tok/s  "
        f"{c32 * LENGTH / forward:5.2f}x forward  {c32 * LENGTH / reference:5.2f}x transformers",
        f"mixed         TPOT p50 {engine['tpot_alone_ms']:.1f} ms alone, "
        f"{engine['tpot_flood_ms']:.1f} ms under an embeddings flood: "
        f"{engine['tpot_flood_ms'] / engine['tpot_alone_ms']:.2f}x",
    ]
    print("\n".join(lines))
    if args.json is not None:
        record = {"forward_tok_s": forward, "transformers_tok_s": reference, **engine}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
