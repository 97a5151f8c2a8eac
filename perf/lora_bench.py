"""LoRA adapters against the base model, one engine, one run (issue 30, item 5).

    .venv/bin/python perf/lora_bench.py [--rounds 3] [--tokens 64] [--threads N]
        [--step-repeats 20] [--json FILE]

On the default model (SmolLM2-135M), with `--enable-lora --max-loras 4 --max-lora-rank 16`
and four random rank-16 adapters of every target (q/k/v/o, gate/up/down):
- output tokens per second at concurrency 32 (32-token prompts, `--tokens` greedy tokens
  each), the requests spread over the four adapters (8 each), against the same load on the
  base model alone (goal >= 0.75x);
- the cost of a load into a slot: copying one adapter, already in host memory, into a device
  slot of every layer (`LoraManager`, in this process), in ms;
- time per output token at concurrency 1 with one adapter against the base (goal <= 1.25x);
- the C decode step alone (`CpuStep.run`, where LoRA decode steps run on the CPU: the
  deltas are added inside it, csrc/tl_lora.h) of 32 decodes over the 4 adapters and of 1
  decode with one, against the same calls without adapters: the kernel's own cost, apart
  from the engine's host work and from the load on a shared machine between rounds.
Base and adapter runs alternate in rounds on one engine (in this process), the C steps call
by call; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import trio
from safetensors.torch import save_file

from trillm.common.config import WorkerConfig
from trillm.common.wire import LoraModule
from trillm.default_model import default_model_dir
from trillm.engine import EngineConfig, LLMConfig, open_llm
from trillm.engine.client import AsyncLLM
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.gpu import ModelRunner, TensorParallel, open_model

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
RANK, ADAPTERS, CONCURRENCY = 16, 4, 32
CONTEXT = 64  # a C step's tokens' context (`c_step_ms`): the 32-token prompts, 32 in


def write_adapter(path: Path, model_dir: Path, seed: int) -> Path:
    """A random rank-16 PEFT adapter of every target of the model in `model_dir`."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, targets in TARGETS.items():
            for target in targets:
                fan_in, fan_out = shapes[target]
                name = f"base_model.model.model.layers.{layer}.{block}.{target}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator)
                tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v * 0.01 for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(
        TARGETS["self_attn"] + TARGETS["mlp"]), "bias": "none"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(peft))
    return path


async def throughput(llm: AsyncLLM, names: list[str | None], tokens: int) -> float:
    """Output tokens per second of `len(names)` concurrent requests (request i: names[i])."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, name in enumerate(names):
            prompt = list(range(1000 + 40 * i, 1032 + 40 * i))
            nursery.start_soon(lambda p=prompt, n=name: llm.complete(p, params, lora_name=n))
    return len(names) * tokens / (time.perf_counter() - started)


async def tpot(llm: AsyncLLM, name: str | None, tokens: int) -> float:
    """Median seconds between output tokens of one request alone."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stamps = []
    async with llm.generate(list(range(2000, 2032)), params, lora_name=name) as stream:
        async for _ in stream:
            stamps.append(time.perf_counter())
    return statistics.median(np.diff(stamps[1:]).tolist())


def step_runner(model_dir: Path, paths: list[Path]) -> ModelRunner:
    """A runner of the model with every adapter in a slot (slot i: adapter i + 1)."""
    config = WorkerConfig(
        str(model_dir), device="cpu", enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK
    )
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
    runner.load_model(weights)
    runner.init_kv_cache(CONCURRENCY * -(-CONTEXT // runner.block_size))
    assert runner.lora is not None
    for i, path in enumerate(paths):
        runner.lora.add(LoraModule(f"a{i}", str(path), None, i + 1))
        runner.lora._load(i, i + 1)
    return runner


def slot_load_ms(runner: ModelRunner, repeats: int = 20) -> float:
    """Median ms to copy one adapter from host memory into a device slot (every layer)."""
    lora = runner.lora
    assert lora is not None
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        lora._load(0, 1)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def c_step_ms(runner: ModelRunner, repeats: int) -> dict[str, float]:
    """Median ms of one C decode step (`CpuStep.run`, the call alone) of 32 decodes with the
    4 adapters spread over them (8 each, interleaved) and of 1 decode with one adapter,
    against the same steps on the base model; the two sides alternate call by call. Each
    token sits at position CONTEXT - 1 of its own blocks."""
    step = runner.cpu_step
    assert step is not None
    block = runner.block_size
    out: dict[str, float] = {}
    for m in (CONCURRENCY, 1):
        positions = np.full(m, CONTEXT - 1, np.int64)
        table = np.arange(m * -(-CONTEXT // block), dtype=np.int32).reshape(m, -1)
        kv_slots = table[:, (CONTEXT - 1) // block].astype(np.int64) * block + (CONTEXT - 1) % block
        lens = positions.astype(np.int32) + 1
        ids = torch.arange(1000, 1000 + m)
        slots = np.arange(m, dtype=np.int32) % ADAPTERS
        times: dict[str, list[float]] = {"base": [], "lora": []}
        for _ in range(repeats):
            for side, lora in (("base", None), ("lora", slots)):
                started = time.perf_counter()
                step.run(ids, positions, kv_slots, lens, table, lora_slots=lora)
                times[side].append(time.perf_counter() - started)
        for side, values in times.items():
            out[f"c_step_m{m}_{side}_ms"] = 1000 * statistics.median(values)
        out[f"c_step_m{m}_ratio"] = statistics.median(times["lora"]) / statistics.median(
            times["base"]
        )
    return out


async def main_async(args: argparse.Namespace, model_dir: Path, paths: list[Path]) -> dict:
    modules = tuple(LoraModule(f"a{i}", str(p)) for i, p in enumerate(paths))
    worker = WorkerConfig(
        str(model_dir), device="cpu", enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK
    )
    config = LLMConfig(EngineConfig(worker=worker, lora_modules=modules), in_process=True)
    names = [f"a{i % ADAPTERS}" for i in range(CONCURRENCY)]
    runs: dict[str, list[float]] = {k: [] for k in ("base", "lora", "tpot_base", "tpot_lora")}
    async with open_llm(config) as llm:
        await throughput(llm, [None, *names[:ADAPTERS]], 4)  # warm-up: every adapter in a slot
        for _ in range(args.rounds):
            runs["base"].append(await throughput(llm, [None] * CONCURRENCY, args.tokens))
            runs["lora"].append(await throughput(llm, list(names), args.tokens))
            runs["tpot_base"].append(await tpot(llm, None, args.tokens))
            runs["tpot_lora"].append(await tpot(llm, "a0", args.tokens))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "output_tok_s_c32_base": med["base"],
        "output_tok_s_c32_4_adapters": med["lora"],
        "throughput_ratio": med["lora"] / med["base"],
        "tpot_c1_base_ms": 1000 * med["tpot_base"],
        "tpot_c1_adapter_ms": 1000 * med["tpot_lora"],
        "tpot_ratio": med["tpot_lora"] / med["tpot_base"],
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--step-repeats", type=int, default=20, help="C decode steps timed per side and size"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch's CPU threads (0: its default, every core)"
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/trillm-lora-bench"))
    args = parser.parse_args()
    if args.threads:  # on a shared machine, 2 threads wait on each other in every small op
        torch.set_num_threads(args.threads)
    model_dir = Path(default_model_dir(progress=False))
    paths = [write_adapter(args.dir / f"a{i}", model_dir, seed=i) for i in range(ADAPTERS)]
    result = trio.run(main_async, args, model_dir, paths)
    runner = step_runner(model_dir, paths)
    result["slot_load_ms"] = slot_load_ms(runner)
    result |= c_step_ms(runner, args.step_repeats)
    r = result
    print(
        f"output tok/s at c={CONCURRENCY}: base {r['output_tok_s_c32_base']:.1f}, {ADAPTERS} "
        f"adapters of rank {RANK} {r['output_tok_s_c32_4_adapters']:.1f} "
        f"({r['throughput_ratio']:.2f}x; goal >= 0.75x)"
    )
    print(f"load into a slot: {r['slot_load_ms']:.2f} ms")
    for m in (CONCURRENCY, 1):
        print(
            f"C decode step of {m}: base {r[f'c_step_m{m}_base_ms']:.2f} ms, adapters "
            f"{r[f'c_step_m{m}_lora_ms']:.2f} ms ({r[f'c_step_m{m}_ratio']:.2f}x)"
        )
    print(
        f"TPOT at c=1: base {r['tpot_c1_base_ms']:.2f} ms, one adapter "
        f"{r['tpot_c1_adapter_ms']:.2f} ms ({r['tpot_ratio']:.2f}x; goal <= 1.25x)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
