"""Decode step time and prefill TFLOP/s of a Llama-3.2-1B-shaped model, against the HBM roofline.

A dummy-weight (random) model with Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query and
8 KV heads of 64, intermediate 8192, vocab 128256, tied embeddings) runs in bfloat16 through
the real `ModelRunner`, driven step by step (`tests/gpu/driver.py`):

- decode: B prompts of `--context` tokens prefilled in one step, then one decode step per
  token; the median step time (synchronised wall clock, so host work counts) at each batch
  size with CUDA graphs, and eager (`enforce_eager=True`) at `--eager-batches` (batch 1: the
  launch-bound case, where graphs matter most), each against the roofline: the
  bytes a step must read from HBM (every weight once, plus the KV cache of every sequence)
  over the copy bandwidth measured in this run (a large device-to-device copy, counting bytes
  read and written). Graph replays are counted by wrapping `torch.cuda.CUDAGraph.replay`,
  so a decode that silently ran eager shows;
- prefill: one prompt of 512 and of 2048 tokens; TFLOP/s of the matmuls and causal attention.

    python perf/gpu_bench.py [--json PATH] [--batches 1,8,32,64] [--eager-batches 1] [--context 512]
    python perf/gpu_bench.py --dry-run   # the same code on CPU: a tiny model, 2 iterations
    python perf/gpu_bench.py --count-launches   # kernels per decode step (CPU or CUDA)

`--count-launches` counts the kernels of one eager decode step, per step and per layer, of
Llama 3.2 1B's and SmolLM2-135M's layer structure (on the CPU with narrow widths: the count
does not depend on them), with the attention backend of CUDA (Triton; its interpreter on the
CPU): the aten ops that launch a kernel and the Triton launches (`_launch_count.py`). On CUDA
it adds torch.profiler's count of the kernels that ran, eager and in a graph replay.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gpu.driver import Driver, DriverRequest  # noqa: E402 - the runner's minimal driver
from trillm.gpu import (  # noqa: E402
    ModelConfig,
    ModelRunner,
    StepBatch,
    TensorParallel,
    WorkerConfig,
    open_model,
)

# Llama 3.2 1B's config.json, less its weights.
LLAMA_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# The dry run's stand-in: the same code path in a fraction of a second per step on CPU.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# SmolLM2-135M-Instruct's (the default model's) config.json, less its weights.
SMOLLM2: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Widths the CPU counts launches at: the same ops at a fraction of the arithmetic.
NARROW = {"hidden_size": 96, "intermediate_size": 192, "head_dim": 16, "vocab_size": 2048}
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096


class NoCudaError(RuntimeError):
    """The benchmark needs a CUDA device and none is visible."""


def llama_config(shape: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A Hugging Face Llama config.json for `shape` (LLAMA_1B or TINY), with `overrides`."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, **overrides}


def write_model_dir(path: Path, config: dict[str, Any]) -> Path:
    """A model directory holding only config.json: what `load_format="dummy"` reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return path


# -- what a step must move and compute ---------------------------------------------------------


def linear_params(mc: ModelConfig) -> int:
    """Parameters of every layer's matmuls (q, k, v, o, gate, up, down)."""
    h, d = mc.hidden_size, mc.head_dim
    attention = h * (mc.num_heads + 2 * mc.num_kv_heads) * d + mc.num_heads * d * h
    return mc.num_layers * (attention + 3 * h * mc.intermediate_size)


def weight_bytes(mc: ModelConfig, element: int) -> int:
    """Bytes of weights one decode step reads: every matmul and norm once, and the
    vocab x hidden matrix once (the logits; tied, the embedding lookup reads only B rows)."""
    norms = (2 * mc.num_layers + 1) * mc.hidden_size
    return element * (linear_params(mc) + norms + mc.vocab_size * mc.hidden_size)


def kv_bytes(mc: ModelConfig, tokens: int, element: int) -> int:
    """Bytes of K and V that attention reads over `tokens` cached tokens (all sequences)."""
    return element * tokens * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim


def prefill_flops(mc: ModelConfig, tokens: int) -> int:
    """FLOPs of one prompt's prefill: the matmuls over every token, causal attention (QK^T
    and PV over T(T+1)/2 query-key pairs per head), and the logits of the last token."""
    attention = 2 * mc.num_layers * mc.num_heads * mc.head_dim * tokens * (tokens + 1)
    return 2 * linear_params(mc) * tokens + attention + 2 * mc.vocab_size * mc.hidden_size


# -- measuring ---------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 2):  # two warm-ups
        synchronize(device)
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            dst.copy_(src)
            seconds = time.perf_counter() - start
        if i >= 2:
            times.append(seconds)
    del src, dst
    return 2 * nbytes / statistics.median(times)


@contextlib.contextmanager
def counting_graph_replays() -> Iterator[list[int]]:
    """Counts `torch.cuda.CUDAGraph.replay` calls inside the block (into the yielded cell)."""
    cell = [0]
    original = torch.cuda.CUDAGraph.replay

    def replay(graph: torch.cuda.CUDAGraph) -> None:
        cell[0] += 1
        original(graph)

    torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    try:
        yield cell
    finally:
        torch.cuda.CUDAGraph.replay = original  # type: ignore[method-assign]


@contextlib.contextmanager
def recording_paths() -> Iterator[collections.Counter[str]]:
    """Counts the path each step inside the block took (`_forward.choose_path`: graph,
    eager, C step...), so a replay count that falls short explains itself (issue 48)."""
    import trillm.gpu.runner._model_runner as model_runner

    counts: collections.Counter[str] = collections.Counter()
    original = model_runner.choose_path

    def choose(*args: Any, **kwargs: Any) -> Any:
        path = original(*args, **kwargs)
        counts[path.name.lower()] += 1
        return path

    model_runner.choose_path = choose
    try:
        yield counts
    finally:
        model_runner.choose_path = original


def run_requests(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int, first_rnum: int
) -> list[float]:
    """Seconds of each step (the prefill first) of a greedy run; the rows are released after."""
    times: list[float] = []
    execute = runner.execute

    def timed(batch: StepBatch) -> Any:
        synchronize(runner.device)
        start = time.perf_counter()
        out = execute(batch)
        synchronize(runner.device)
        times.append(time.perf_counter() - start)
        return out

    driver = Driver(runner, runner.kv_caches[0][0].shape[0])
    requests = [DriverRequest(first_rnum + i, p, new_tokens) for i, p in enumerate(prompts)]
    runner.execute = timed  # type: ignore[method-assign]
    try:
        driver.run(requests)
    finally:
        runner.execute = execute  # type: ignore[method-assign]
    rnums = np.array([r.rnum for r in requests], np.uint64)
    execute(StepBatch(driver.step, finished_rnums=rnums))  # the driver never says "finished"
    return times


def open_runner(
    model_dir: Path,
    device: torch.device,
    *,
    enforce_eager: bool,
    attention_backend: str,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    cpu_linear: str = "auto",
) -> tuple[ModelRunner, dict[str, Any]]:
    """A runner with random weights and `num_blocks` KV blocks; CUDA graphs captured as the
    worker does (after the KV cache, on CUDA, unless eager). Returns what the capture took.

    `max_num_batched_tokens` covers the one-step prefill of every prompt of a batch (the
    driver schedules no chunks), in case a backend sizes buffers by it."""
    config = WorkerConfig(
        str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        device=str(device),
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        attention_backend=attention_backend,
        enforce_eager=enforce_eager,
        cpu_linear=cpu_linear,
    )
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), device)
    runner.load_model(weights)
    runner.init_kv_cache(num_blocks)
    capture: dict[str, Any] = {
        "captured": False,
        "sizes": list(config.cuda_graph_sizes()),
        "reason": None,
        "seconds": None,
        "reserved_bytes": None,
        "returned": None,  # what capture_cuda_graphs() returned, made JSON
    }
    if device.type != "cuda" or enforce_eager:
        capture["reason"] = "eager" if enforce_eager else "CPU: graphs are CUDA only"
        return runner, capture
    if not hasattr(runner, "capture_cuda_graphs"):
        capture["reason"] = "ModelRunner has no capture_cuda_graphs()"
        return runner, capture
    synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    returned = runner.capture_cuda_graphs()
    synchronize(device)
    capture |= {
        "captured": True,
        "seconds": time.perf_counter() - start,
        "reserved_bytes": torch.cuda.memory_reserved(device) - reserved,
        "returned": _jsonable(returned),
    }
    return runner, capture


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    return repr(value)


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (batch, length), generator=g).tolist()


# -- the benchmark -----------------------------------------------------------------------------


def decode_times(
    runner: ModelRunner, batches: list[int], context: int, steps: int
) -> dict[int, tuple[float, int, dict[str, int]]]:
    """Per batch size: the median decode step (s), how many CUDA graph replays it made, and
    how many of its steps took each path (the prefill step among them).

    The warm-up (kernels compiled, caches filled) prefills one block per sequence, not the
    run's whole context: at batch 64 that is 1k tokens rather than 32k."""
    vocab = runner.model_config.vocab_size
    result = {}
    for b in batches:
        warm = prompts(b, BLOCK_SIZE, vocab, seed=-b % 2**31)
        run_requests(runner, warm, 3, first_rnum=10_000 * b)
        batch = prompts(b, context, vocab, seed=b)
        with counting_graph_replays() as replays, recording_paths() as paths:
            times = run_requests(runner, batch, steps + 1, first_rnum=10_000 * b + 1000)
        result[b] = (statistics.median(times[1:]), replays[0], dict(paths))
    return result


def prefill_times(runner: ModelRunner, lengths: list[int], repeats: int) -> dict[int, float]:
    """Per prompt length: the median prefill step (s), one prompt alone."""
    vocab = runner.model_config.vocab_size
    result = {}
    for n in lengths:
        prompt = prompts(1, n, vocab, seed=n)
        run_requests(runner, prompt, 1, first_rnum=1_000_000 + n)  # warm-up
        times = [
            run_requests(runner, prompt, 1, first_rnum=1_000_001 + n + i)[0] for i in range(repeats)
        ]
        result[n] = statistics.median(times)
    return result


def free_memory(device: torch.device) -> None:
    """Return what dropped runners held (weights, KV cache, graph pools) to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def benchmark(args: argparse.Namespace, device: torch.device, model_dir: Path) -> dict[str, Any]:
    mc = open_model(str(model_dir), "dummy")[0]
    element = torch.empty(0, dtype=torch.bfloat16).element_size()
    batches = [int(b) for b in args.batches.split(",")]
    eager_batches = [int(b) for b in args.eager_batches.split(",")]
    lengths = [int(n) for n in args.prefill_lens.split(",")]
    blocks_per_seq = -(-(max(args.context + args.steps + 4, max(lengths) + 2)) // BLOCK_SIZE)
    bandwidth = copy_bandwidth(device, args.copy_mib << 20, args.repeats)
    decode: dict[str, dict[int, tuple[float, int]]] = {}
    captures: dict[str, dict[str, Any]] = {}
    prefill: dict[int, float] = {}
    for mode, eager, sizes in (("eager", True, eager_batches), ("graphs", False, batches)):
        # Sized to this mode's runs: the largest batch's one-step prefill (and, eager, the
        # prefill lengths), its KV blocks and rows.
        runner, captures[mode] = open_runner(
            model_dir,
            device,
            enforce_eager=eager,
            attention_backend=args.attention_backend,
            num_blocks=max(sizes) * blocks_per_seq + 8,
            max_num_seqs=max(sizes),
            max_num_batched_tokens=max(max(sizes) * args.context, max(lengths) if eager else 0),
        )
        decode[mode] = decode_times(runner, sizes, args.context, args.steps)
        if eager:  # graphs are decode-only: the prefill is the same either way
            prefill = prefill_times(runner, lengths, args.repeats)
        del runner
        free_memory(device)
    weights = weight_bytes(mc, element)
    mean_context = args.context + (args.steps + 1) / 2  # cached tokens per sequence, on average
    decode_rows = []
    for b in batches:
        kv = kv_bytes(mc, round(b * mean_context), element)
        roofline_s = (weights + kv) / bandwidth
        graphs_s, graphs_replays, graphs_paths = decode["graphs"][b]
        eager_s, eager_replays, eager_paths = decode["eager"].get(b, (None, None, None))
        decode_rows.append(
            {
                "batch": b,
                "context": args.context,
                "decode_steps": args.steps,
                "eager_ms": eager_s and eager_s * 1e3,
                "graphs_ms": graphs_s * 1e3,
                "graphs_speedup": eager_s and eager_s / graphs_s,
                "eager_tok_s": eager_s and b / eager_s,
                "graphs_tok_s": b / graphs_s,
                "weight_bytes": weights,
                "kv_bytes": kv,
                "roofline_ms": roofline_s * 1e3,
                "eager_of_roofline": eager_s and roofline_s / eager_s,
                "graphs_of_roofline": roofline_s / graphs_s,
                "eager_graph_replays": eager_replays,
                "graph_replays": graphs_replays,
                "graphs_paths": graphs_paths,  # steps per path: prefill, then decodes
                "eager_paths": eager_paths,
            }
        )
    prefill_rows = [
        {
            "tokens": n,
            "ms": seconds * 1e3,
            "flops": prefill_flops(mc, n),
            "tflops": prefill_flops(mc, n) / seconds / 1e12,
        }
        for n, seconds in prefill.items()
    ]
    return {
        "copy_bytes": 2 * (args.copy_mib << 20),
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "capture": captures,
        "decode": decode_rows,
        "prefill": prefill_rows,
        "problems": problems(device, captures, decode_rows),
    }


def problems(
    device: torch.device, captures: dict[str, dict[str, Any]], decode_rows: list[dict[str, Any]]
) -> list[str]:
    """What on CUDA says the graphs did not run as they should (empty on CPU)."""
    found = []
    if device.type != "cuda":
        return found
    if not captures["graphs"]["captured"]:
        found.append(f"no CUDA graphs were captured: {captures['graphs'].get('reason')}")
    for row in decode_rows:
        if row["graph_replays"] < row["decode_steps"]:
            paths = ", ".join(f"{n} {p}" for p, n in sorted(row["graphs_paths"].items()))
            found.append(
                f"batch {row['batch']}: {row['graph_replays']} graph replays in "
                f"{row['decode_steps']} decode steps (graphs on: every decode step should "
                f"replay); the steps' paths: {paths}"
            )
        if row["eager_graph_replays"]:
            found.append(f"batch {row['batch']}: enforce_eager=True still replayed graphs")
    return found


def table(result: dict[str, Any]) -> list[str]:
    """The report as printed lines."""
    model = result["model"]
    lines = [
        f"gpu_bench on {result['device_name']}: {model['name']}, {result['dtype']}, dummy "
        f"weights, attention {result['attention_backend']}, "
        f"{model['weight_bytes'] / 1e9:.2f} GB of weights",
        f"copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s (read + written), "
        f"decode at context {result['decode'][0]['context']}, median of "
        f"{result['decode'][0]['decode_steps']} steps",
        "batch  eager ms  graphs ms  speedup  roofline ms  eager/roof  graphs/roof  replays",
    ]
    for r in result["decode"]:
        eager = r["eager_ms"] is not None  # eager runs only at --eager-batches
        eager_ms = f"{r['eager_ms']:.3f}" if eager else "-"
        speedup = f"{r['graphs_speedup']:.2f}x" if eager else "-"
        of_roof = f"{r['eager_of_roofline']:.0%}" if eager else "-"
        lines.append(
            f"{r['batch']:>5}  {eager_ms:>8}  {r['graphs_ms']:9.3f}  {speedup:>7}  "
            f"{r['roofline_ms']:11.3f}  {of_roof:>9}  {r['graphs_of_roofline']:10.0%}  "
            f"{r['graph_replays']:>3}/{r['decode_steps']}"
        )
    capture = result["capture"]["graphs"]
    if capture["captured"]:
        lines.append(
            f"graph capture: {capture['seconds']:.2f} s, "
            f"{capture['reserved_bytes'] / 2**20:.0f} MiB reserved, sizes {capture['sizes']}"
        )
    else:
        lines.append(f"graph capture: none ({capture.get('reason')})")
    for p in result["prefill"]:
        lines.append(
            f"prefill {p['tokens']:>5} tokens: {p['ms']:8.3f} ms, {p['tflops']:7.2f} TFLOP/s"
        )
    lines.extend(f"PROBLEM: {p}" for p in result["problems"])
    return lines


def count_launches(args: argparse.Namespace, device: torch.device, tmp: Path) -> dict[str, Any]:
    """Kernels per eager decode step (and per graph replay on CUDA) of each model's layers."""
    from _launch_count import count_decode, count_mixed

    backend = "triton" if args.attention_backend == "auto" else args.attention_backend
    on_cuda = device.type == "cuda"
    context = args.context if on_cuda else 64
    steps = 4  # 3 counted (each the same) and, on CUDA, 1 under the profiler
    shapes = [("Llama-3.2-1B", LLAMA_1B), ("SmolLM2-135M", SMOLLM2)]
    batches = (1, 8)
    if args.dry_run:  # gpu_check.sh --dry-run: the same code in seconds
        shapes, batches, context = [("tiny Llama", TINY)], (1,), 32
    models = []
    for name, shape in shapes:
        if not on_cuda and not args.dry_run:
            heads = shape["num_attention_heads"] // shape["num_key_value_heads"]
            shape = {**shape, **NARROW, "num_attention_heads": heads, "num_key_value_heads": 1}
        model_dir = write_model_dir(tmp / name, llama_config(shape))
        blocks = 8 * (-(-(context + steps + 2) // BLOCK_SIZE)) + 8
        row: dict[str, Any] = {"model": name, "layers": shape["num_hidden_layers"]}
        # eager: the torch ops (the fused kernels off); fused: the fused kernels on (CUDA's
        # eager path with the triton backend; on the CPU through the interpreter); graphs:
        # as the runner chose (CUDA only)
        for mode, eager, fused in (
            ("eager", True, False), ("fused", True, True), ("graphs", False, None),
        ):  # fmt: skip
            if (not eager and not on_cuda) or (fused and backend != "triton"):
                continue  # graphs are CUDA only; the rotary kernel writes triton's cache
            runner, _ = open_runner(
                model_dir, device, enforce_eager=eager, attention_backend=backend,
                num_blocks=blocks, max_num_seqs=8, max_num_batched_tokens=8 * context,
                cpu_linear="aten",
            )  # fmt: skip
            if fused is not None:
                runner.model.use_fused(fused)
            row[mode] = [count_decode(runner, b, context, steps) for b in batches]
            if eager:  # item 3: a mixed step (decodes beside a prompt) runs eager on CUDA too
                row[f"{mode}_mixed"] = count_mixed(
                    runner, max(1, batches[-1] - 1), context, context // 2
                )
            del runner
            free_memory(device)
        models.append(row)
    return {"attention_backend": backend, "context": context, "launches": models}


def launches_table(result: dict[str, Any]) -> list[str]:
    lines = [
        f"kernels per eager decode step on {result['device_name']} (attention "
        f"{result['attention_backend']}, context {result['context']}; CPU: aten ops that "
        "launch + Triton launches, input uploads not counted)",
        "model          mode    layers  batch  per step  per layer  outside  syncs  "
        "same/step  profiler eager  profiler graphs",
    ]
    for m in result["launches"]:
        for mode in ("eager", "fused"):
            for i, c in enumerate(m.get(mode, [])):
                prof = c["cuda_profiler"]
                graphs = m.get("graphs", [None, None])[i] if mode == "fused" else None
                graph_prof = graphs and graphs["cuda_profiler"]
                lines.append(
                    f"{m['model']:<14} {mode:<6} {m['layers']:>6}  {c['batch']:>5}  "
                    f"{c['per_step']:>8}  {c['per_layer']!s:>9}  {c['outside_layers']:>7}  "
                    f"{c['syncs']:>5}  {c['same_every_step']!s:>9}  "
                    f"{prof['kernels'] if prof else '-':>14}  "
                    f"{graph_prof['kernels'] if graph_prof else '-':>15}"
                )
    for m in result["launches"]:
        for mode in ("eager", "fused"):
            c = m.get(f"{mode}_mixed")
            if c is not None:
                lines.append(
                    f"{m['model']:<14} {mode:<6} mixed step ({c['batch']} decodes + a "
                    f"{c['prompt']}-token prompt): {c['per_step']} launches, "
                    f"{c['per_layer']} a layer, {c['outside_layers']} outside"
                )
    first_model = result["launches"][0]
    for mode in ("eager", "fused"):
        if mode not in first_model:
            continue
        first = first_model[mode][0]
        ops = ", ".join(f"{k} {v}" for k, v in first["layer_ops"].items())
        lines.append(f"one layer of {first_model['model']}, {mode}: {ops}")
        ops = ", ".join(f"{k} {v}" for k, v in first["outside_ops"].items())
        lines.append(f"outside the layers, {mode}: {ops}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, 2 iterations")
    parser.add_argument("--batches", default="1,8,32,64", help="decode batches, graphs")
    parser.add_argument("--eager-batches", default="1", help="decode batches run eager too")
    parser.add_argument("--context", type=int, help="prompt tokens per sequence (default 512)")
    parser.add_argument("--steps", type=int, help="decode steps timed (default 32)")
    parser.add_argument("--prefill-lens", help="prompt lengths (default 512,2048)")
    parser.add_argument("--repeats", type=int, help="prefill and copy repeats (default 5)")
    parser.add_argument("--copy-mib", type=int, help="bytes copied for the bandwidth, MiB")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results")
    parser.add_argument(
        "--count-launches",
        action="store_true",
        help="count the kernels per decode step instead (on CUDA if there is one, else CPU)",
    )
    args = parser.parse_args(argv)
    defaults = (
        {"context": 32, "steps": 2, "prefill_lens": "32,128", "repeats": 2, "copy_mib": 64}
        if args.dry_run
        else {
            "context": 512,
            "steps": 32,
            "prefill_lens": "512,2048",
            "repeats": 5,
            "copy_mib": 2048,
        }
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.count_launches:
        cuda = torch.cuda.is_available() and not args.dry_run
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        result: dict[str, Any] = {
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
        }
        with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
            result |= count_launches(args, device, Path(tmp))
        result["table"] = launches_table(result)
        print("\n".join(result["table"]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; run with --dry-run to check it on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    shape, name = (TINY, "tiny Llama") if args.dry_run else (LLAMA_1B, "Llama-3.2-1B shape")
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        model_dir = write_model_dir(Path(tmp), llama_config(shape))
        mc = open_model(str(model_dir), "dummy")[0]
        config = WorkerConfig(str(model_dir), attention_backend=args.attention_backend)
        element = torch.empty(0, dtype=torch.bfloat16).element_size()
        result = {
            "dry_run": args.dry_run,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dtype": "bfloat16",
            "attention_backend": config.attention_backend_for(device),
            "model": {"name": name, **shape, "weight_bytes": weight_bytes(mc, element)},
        }
        result |= benchmark(args, device, model_dir)
    result["table"] = table(result)
    print("\n".join(result["table"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
