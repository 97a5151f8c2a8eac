"""Prefill and decode tokens/s of trillm's model runner against transformers, same machine.

For each dtype and batch size B, both generate N tokens greedily for B prompts of P tokens
(no EOS stop): trillm through a `Worker` driven step by step (all prompts prefilled in the
first step, then one decode step per token), transformers through `generate` (its prefill is
timed as `generate(max_new_tokens=1)`, its decode as the rest). Medians of `--repeats` runs.

With `--quantization none,gguf` (a list) trillm runs once per setting on the same GGUF file
(the built-in SmolLM2 Q4_1 file by default), the settings interleaved run by run, against the
first setting instead of transformers; it also prints each setting's bandwidth floor: the
bytes of its weights over this machine's read bandwidth (a 1 GiB `torch.sum`).

    python perf/model_bench.py [--model DIR] [--batches 1,8,32] [--dtypes float32,bfloat16]
    python perf/model_bench.py --quantization none,gguf [--model FILE.gguf] [--batches 1,32]

`--moe` compares a mixture-of-experts decoder (Qwen3-MoE shaped: 64 experts, 8 routed per
token) with the dense Qwen3 of the same *active* parameters (intermediate size 8 x the
experts'), both on dummy weights, decode steps interleaved run by run; the acceptance line is
MoE / dense <= 1.3 at batch 1, which holds only if experts no token chose are never read.

    python perf/model_bench.py --moe [--batches 1,8] [--repeats 5] [--enforce-eager]

`--kernels` times the candidate weight-only kernels alone on SmolLM2's linear shapes at M =
each batch size, interleaved: float32 packed for oneDNN (the baseline), trillm's C tiles
(float32, Q4_1, Q8_0: `lib/gpu/cpu/_tiles.py`), torch's int4 (`_weight_int4pack_mm_for_cpu`) and
int8 (`_weight_int8pack_mm`) kernels with bfloat16 and with float32 activations, and fbgemm's
float16 (`quantized.linear_dynamic_fp16`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gpu.driver import Driver, DriverRequest  # noqa: E402 - the runner's minimal driver
from trillm.gpu import SamplingOptions, Worker, WorkerConfig  # noqa: E402


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, vocab - 1, (batch, length), generator=g).tolist()


def trillm_run(worker: Worker, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Seconds for the prefill step and for the decode steps."""
    times = step_times(worker, batch, new_tokens)
    return times[0], sum(times[1:])


def step_times(worker: Worker, batch: list[list[int]], new_tokens: int) -> list[float]:
    """Seconds of each step: the prefill, then one decode step per further token."""
    blocks = worker.runner.kv_caches[0][0].shape[0]
    driver = Driver(worker.runner, blocks)
    greedy = SamplingOptions(temperature=0.0)
    requests = [DriverRequest(i, p, new_tokens, greedy) for i, p in enumerate(batch)]
    times: list[float] = []
    execute = worker.runner.execute

    def timed(step_batch: Any) -> Any:
        start = time.perf_counter()
        out = execute(step_batch)
        times.append(time.perf_counter() - start)
        return out

    worker.runner.execute = timed  # type: ignore[method-assign]
    try:
        driver.run(requests)
    finally:
        worker.runner.execute = execute  # type: ignore[method-assign]
    return times


def hf_run(model: Any, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor(batch)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return prefill, max(total - prefill, 1e-9)


def read_bandwidth(repeats: int = 7) -> float:
    """Bytes per second a `torch.sum` of 1 GiB of float32 reads (the median of `repeats`)."""
    data = torch.ones(1 << 28)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SHAPES["head"] = (49152, 576)


def kernel_candidates(n: int, k: int, m: int) -> dict[str, Any]:
    """name -> a call computing [m, k] x [n, k]^T with that kernel (random weights)."""
    from trillm.gpu.cpu._cpu_linear import pack_weight, packed_linear

    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k)
    xb = x.bfloat16()
    packed = pack_weight(w)
    q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 1
    )
    sz = torch.rand(k // 32, n, 2)
    q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
    fp16 = torch.ops.quantized.linear_prepack_fp16(w, None)
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu
    int8 = torch.ops.aten._weight_int8pack_mm
    calls = {
        "float32": lambda: packed_linear(x, packed, None),
        **c_tile_candidates(w, x),
        "int4_bf16": lambda: int4(xb, q4, 32, sz.bfloat16()),
        "int8_bf16": lambda: int8(xb, q8, s8.bfloat16()),
        "fp16_fbgemm": lambda: torch.ops.quantized.linear_dynamic_fp16(x, fp16),
    }
    if m == 1:  # the float32-activation paths are scalar: too slow to time at larger M
        calls["int4_f32"] = lambda: int4(x, q4, 32, sz)
        calls["int8_f32"] = lambda: int8(x, q8, s8)
    return calls


def c_tile_candidates(w: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    """trillm's C tiles (`lib/gpu/cpu/_tiles.py`): float32, and the weight as Q4_1 and Q8_0
    blocks (float32 activations); none where the C kernels do not build here."""
    from linear_bench import gguf_blocks

    from trillm.gpu.cpu._tiles import TiledLinear, dense_tiles, quantized_tiles, tiled_kernels
    from trillm.gpu.quant._gguf_blocks import Q4_1, Q8_0

    if tiled_kernels() is None:
        return {}
    n = w.shape[0]
    calls = {"c_f32": TiledLinear(dense_tiles(w), n)}
    for name, qtype in (("c_q4_1", Q4_1), ("c_q8_0", Q8_0)):
        calls[name] = TiledLinear(quantized_tiles([gguf_blocks(w, qtype)]), n)
    return {name: (lambda linear=linear: linear(x)) for name, linear in calls.items()}


def kernels_main(args: argparse.Namespace) -> None:
    """Each candidate kernel against float32 oneDNN on each shape, interleaved, medians."""
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; median ms (x = float32 / kernel)"
    )
    for m in map(int, args.batches.split(",")):
        for name, (n, k) in SHAPES.items():
            calls = kernel_candidates(n, k, m)
            times: dict[str, list[float]] = {c: [] for c in calls}
            for call in calls.values():
                call()
            for _ in range(args.repeats):
                for c, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[c].append(time.perf_counter() - start)
            base = statistics.median(times["float32"])
            cells = [
                f"{c} {statistics.median(t) * 1e3:.3f} (x{base / statistics.median(t):.2f})"
                for c, t in times.items()
            ]
            print(f"M={m:<4} {name:<8} " + "  ".join(cells), flush=True)


def quantization_main(args: argparse.Namespace) -> None:
    """Each `--quantization` setting on the same GGUF file, interleaved, against the first."""
    if args.model is None:
        from trillm.default_model import find_default_gguf

        args.model = str(find_default_gguf())
    settings = args.quantization.split(",")
    rows = []
    bandwidth = read_bandwidth()
    print(f"read bandwidth (1 GiB torch.sum): {bandwidth / 1e9:.1f} GB/s", flush=True)
    for dtype in args.dtypes.split(","):
        workers = {}
        for q in settings:
            config = WorkerConfig(
                args.model, device="cpu", dtype=dtype, max_num_seqs=64, quantization=q
            )
            worker = workers[q] = Worker(config)
            worker.init_device()
            worker.load_model()
            worker.init_kv_cache(worker.num_available_kv_blocks())
            assert worker.runner.model is not None
            model = worker.runner.model
            read = model.decode_read_bytes()
            print(
                f"{dtype:<9} {q:<5} {worker.kernels.describe()}\n"
                f"{'':15} weights {model.weight_bytes() / 1e6:.1f} MB, {read / 1e6:.1f} MB "
                f"read a decode step: floor {read / bandwidth * 1e3:.1f} ms",
                flush=True,
            )
        vocab = next(iter(workers.values())).runner.model_config.vocab_size
        for b in map(int, args.batches.split(",")):
            batch = prompts(b, args.prompt_len, vocab)
            for worker in workers.values():
                trillm_run(worker, batch, 2)  # warm-up
            runs: dict[str, list[tuple[float, float]]] = {q: [] for q in settings}
            for _ in range(args.repeats):
                for q, worker in workers.items():
                    runs[q].append(trillm_run(worker, batch, args.new_tokens))
            steps = args.new_tokens - 1
            base_prefill = statistics.median(t[0] for t in runs[settings[0]])
            base_decode = statistics.median(t[1] for t in runs[settings[0]])
            for q in settings:
                prefill = statistics.median(t[0] for t in runs[q])
                decode = statistics.median(t[1] for t in runs[q])
                rows.append(
                    {
                        "dtype": dtype,
                        "quantization": q,
                        "batch": b,
                        "prefill_ms": prefill * 1e3,
                        "decode_step_ms": decode / steps * 1e3,
                        "prefill_tok_s": b * args.prompt_len / prefill,
                        "decode_tok_s": b * steps / decode,
                    }
                )
                print(
                    f"{dtype:<9} {q:<5} B={b:<3} prefill {prefill * 1e3:8.1f} ms "
                    f"(x{base_prefill / prefill:.2f})  decode step {decode / steps * 1e3:7.2f} ms "
                    f"(x{base_decode / decode:.2f}), {b * steps / decode:7.1f} tok/s",
                    flush=True,
                )
    write_json(args, rows, read_bandwidth_gb_s=bandwidth / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face model dir (default: the built-in SmolLM2)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--quantization",
        help="compare trillm's --quantization settings on one GGUF file (e.g. none,gguf; "
        "the first is the baseline) instead of trillm against transformers",
    )
    parser.add_argument(
        "--kernels", action="store_true", help="time the candidate weight-only kernels alone"
    )
    parser.add_argument(
        "--moe", action="store_true", help="a MoE decoder against the dense one of its active size"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no C decode step (--moe)")
    args = parser.parse_args()
    if args.moe:
        moe_main(args)
        return
    if args.kernels:
        kernels_main(args)
        return
    if args.quantization is not None:
        quantization_main(args)
        return
    if args.model is None:
        from trillm.default_model import default_model_dir

        args.model = str(default_model_dir())
    rows = []
    for dtype in args.dtypes.split(","):
        worker = Worker(WorkerConfig(args.model, device="cpu", dtype=dtype, max_num_seqs=64))
        worker.init_device()
        worker.load_model()
        worker.init_kv_cache(worker.num_available_kv_blocks())
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, dtype)
        ).eval()
        vocab = worker.runner.model_config.vocab_size
        for b in map(int, args.batches.split(",")):
            batch = prompts(b, args.prompt_len, vocab)
            trillm_run(worker, batch, 2)  # warm-up
            hf_run(hf, batch, 2)
            ours = [trillm_run(worker, batch, args.new_tokens) for _ in range(args.repeats)]
            theirs = [hf_run(hf, batch, args.new_tokens) for _ in range(args.repeats)]
            decoded = b * (args.new_tokens - 1)
            row = {
                "dtype": dtype,
                "batch": b,
                "prefill_tok_s": b * args.prompt_len / statistics.median(t[0] for t in ours),
                "hf_prefill_tok_s": b * args.prompt_len / statistics.median(t[0] for t in theirs),
                "decode_tok_s": decoded / statistics.median(t[1] for t in ours),
                "hf_decode_tok_s": decoded / statistics.median(t[1] for t in theirs),
            }
            rows.append(row)
            prefill_x = row["prefill_tok_s"] / row["hf_prefill_tok_s"]
            decode_x = row["decode_tok_s"] / row["hf_decode_tok_s"]
            print(
                f"{dtype:<9} B={b:<3} prefill {row['prefill_tok_s']:8.0f} tok/s "
                f"(transformers {row['hf_prefill_tok_s']:8.0f}, x{prefill_x:.2f})  "
                f"decode {row['decode_tok_s']:7.1f} tok/s "
                f"(transformers {row['hf_decode_tok_s']:7.1f}, x{decode_x:.2f})",
                flush=True,
            )
    write_json(args, rows)


MOE_SHAPE: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MOE_EXPERTS = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256)


def moe_main(args: argparse.Namespace) -> None:
    """Decode tokens/s of the MoE model and of the dense one with its active parameters."""
    import tempfile

    active = MOE_EXPERTS["num_experts_per_tok"] * MOE_EXPERTS["moe_intermediate_size"]
    configs = {
        "moe": dict(MOE_SHAPE, model_type="qwen3_moe", intermediate_size=active, **MOE_EXPERTS),
        "dense": dict(MOE_SHAPE, model_type="qwen3", intermediate_size=active),
    }
    workers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            path = Path(tmp) / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config))
            worker = Worker(
                WorkerConfig(
                    str(path),
                    device="cpu",
                    dtype="float32",
                    load_format="dummy",
                    max_num_seqs=64,
                    kv_cache_bytes=1 << 28,
                    enforce_eager=args.enforce_eager,
                )
            )
            worker.init_device()
            worker.load_model()
            worker.init_kv_cache(worker.num_available_kv_blocks())
            workers[name] = worker
            model = worker.runner.model
            assert model is not None and worker.runner.kernels is not None
            print(
                f"{name:<5}: {model.weight_bytes() / 2**20:7.1f} MiB of weights, "
                f"{model.decode_read_bytes() / 2**20:6.1f} MiB read per decode token; "
                f"decode {worker.runner.kernels.decode[:70]}",
                flush=True,
            )
    rows = []
    for b in map(int, args.batches.split(",")):
        batch = prompts(b, args.prompt_len, MOE_SHAPE["vocab_size"])
        times: dict[str, list[float]] = {name: [] for name in workers}
        for worker in workers.values():
            trillm_run(worker, batch, 2)  # warm-up
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for name, worker in workers.items():
                times[name] += step_times(worker, batch, args.new_tokens)[1:]
        step = {name: statistics.median(t) for name, t in times.items()}  # per decode step
        ratio = step["moe"] / step["dense"]
        rows.append(
            {
                "batch": b,
                "moe_step_ms": step["moe"] * 1e3,
                "dense_step_ms": step["dense"] * 1e3,
                "ratio": ratio,
            }
        )
        print(
            f"B={b:<3} decode step: moe {step['moe'] * 1e3:7.2f} ms, "
            f"dense {step['dense'] * 1e3:7.2f} ms, "
            f"moe / dense {ratio:.2f} (median step of {args.repeats} x {args.new_tokens - 1})",
            flush=True,
        )
    write_json(args, rows)


def write_json(args: argparse.Namespace, rows: list[dict[str, Any]], **extra: float) -> None:
    """The run's settings and rows to `--json`, if given."""
    if args.json:
        run = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, **extra}
        Path(args.json).write_text(json.dumps({**run, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
