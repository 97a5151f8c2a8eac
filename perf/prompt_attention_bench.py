"""The C attention of prompt steps against a baseline build of the kernels, in one process.

Two builds of `lib/gpu/cpu/csrc` are loaded side by side, this tree's and a git revision's
(`--base`, default HEAD), and run alternately (base first on even rounds, second on odd), so a
loaded machine's drift falls on both:
- kernel: one layer's `trillm_attention` at SmolLM2-135M's attention shape (9 query heads over
  3 kv heads, head dim 64, 16-token cache blocks, rotary) for prompt steps (16 x 128, 1 x 512,
  1 x 2048; float32 and bfloat16 caches), a mixed step (32 decodes at 160 keys and a 160-token
  prompt) and decode-only steps (64 at 512 keys in float32; 32 at 160 and at 512, and 128 at
  512 in bfloat16). Those of 64 and 128 at 512 hold a cache past the L3 of the machines here
  (50 MB), as a real step's 30 layers do: the others' caches stay in L2/L3 across repeats;
- step (`--step`): the whole prefill step of `--prompts` x `--prompt-len` through the worker
  (SmolLM2-135M, `--dtype`), the runner's C library swapped between the builds step by step,
  the attention timed at its calls (`CAttention.attend_qkv`); `--sdpa` adds torch's SDPA
  (the path past `PROMPT_CONTEXT_MAX`, lowered to 0 for its steps; its attention is in no
  timed call), to place the bound.

    python perf/prompt_attention_bench.py [--base REV] [--repeats 15] [--threads 2]
        [--cpu-time] [--step [--prompts 16] [--prompt-len 128] [--step-repeats 5] [--sdpa]
        [--dtype bfloat16]]

Prints medians (ms), the attention's GFLOP/s (4 * head_dim * query heads per query-key pair)
and new / base. `--cpu-time` times by the process's CPU time (one thread: a busy machine's
other work then counts less).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trillm.gpu.cpu import _cpu_decode, _native
from trillm.gpu.cpu._decode_structs import Layer, Model
from trillm.gpu.cpu._hugepages import on_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M
SHAPES: dict[str, tuple[list[tuple[int, int]], torch.dtype]] = {  # (cached, new) a sequence
    "16 x 128 prompts": ([(0, 128)] * 16, torch.float32),
    "16 x 128 bfloat16": ([(0, 128)] * 16, torch.bfloat16),
    "1 x 512 prompt": ([(0, 512)], torch.float32),
    "1 x 2048 prompt": ([(0, 2048)], torch.float32),
    "1 x 2048 bfloat16": ([(0, 2048)], torch.bfloat16),
    "32 decodes + 160": ([(160, 1)] * 32 + [(0, 160)], torch.float32),
    "64 decodes at 512": ([(511, 1)] * 64, torch.float32),
    "32 decodes at 160 bfloat16": ([(159, 1)] * 32, torch.bfloat16),
    "32 decodes at 512 bfloat16": ([(511, 1)] * 32, torch.bfloat16),
    "128 decodes at 512 bfloat16": ([(511, 1)] * 128, torch.bfloat16),
}


def build_base(rev: str) -> ctypes.CDLL:
    """`lib/gpu/cpu/csrc` at git revision `rev`, built as `_native` builds this tree's."""
    root = Path(__file__).resolve().parents[1]
    files = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "lib/gpu/cpu/csrc/"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="trillm-base-"))
    for name in files:
        text = subprocess.run(
            ["git", "show", f"{rev}:{name}"], cwd=root, capture_output=True, check=True
        ).stdout
        (out / Path(name).name).write_bytes(text)
    flags = (*_native.FLAGS, f"-march={os.environ.get('TRILLM_CPU_MARCH') or 'native'}")
    compiler = os.environ.get("CC") or "cc"
    subprocess.run(
        [compiler, *flags, str(out / "cpu_decode.c"), "-o", str(out / "base.so")], check=True
    )
    lib = ctypes.CDLL(str(out / "base.so"))
    shutil.rmtree(out)
    return lib


def layer_call(
    seqs: list[tuple[int, int]], dtype: torch.dtype
) -> tuple[Callable[..., None], float]:
    """A `trillm_attention` call over random inputs of `seqs`, and its FLOPs."""
    torch.manual_seed(0)
    h, g, d, bs = HEADS, KV_HEADS, HEAD_DIM, BLOCK
    counts = [n for _, n in seqs]
    m, width = sum(counts), max(-(-(p + n) // bs) for p, n in seqs)
    # on huge pages, as the worker allocates its cache (`_hugepages`)
    k_cache = on_huge_pages(torch.randn(width * len(seqs), bs, g, d).to(dtype))
    v_cache = on_huge_pages(torch.randn(width * len(seqs), bs, g, d).to(dtype))
    table = torch.randperm(width * len(seqs)).view(-1, width).int()
    qkv = torch.randn(m, (h + 2 * g) * d)
    positions = np.concatenate([np.arange(p, p + n) for p, n in seqs])
    rows = np.repeat(np.arange(len(seqs), dtype=np.int32), counts)
    slots = table[rows, positions // bs].numpy().astype(np.int64) * bs + positions % bs
    context_lens = (positions + 1).astype(np.int32)
    angles = torch.arange(int(positions.max()) + 1)[:, None] * torch.rand(d // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    model = Model(
        num_layers=1, hidden=h * d, num_heads=h, num_kv_heads=g, head_dim=d, block_size=bs,
        cache_type=0 if dtype == torch.float32 else 1, rotary_dim=d, eps=1e-6,
        scale=d**-0.5, residual=1.0,
    )  # fmt: skip
    layer = Layer(
        rope_cos=cos.data_ptr(), rope_sin=sin.data_ptr(), k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
    )  # fmt: skip
    out = torch.empty(m, h * d)
    rope_rows = positions.astype(np.int64)
    prompts = any(n > 1 for n in counts)

    def call(lib: ctypes.CDLL, threads: int) -> None:
        _ = (k_cache, v_cache, qkv, cos, sin)  # alive while the call reads them
        lib.trillm_attention(
            ctypes.byref(model), ctypes.byref(layer), ctypes.c_void_p(k_cache.data_ptr()),
            ctypes.c_void_p(v_cache.data_ptr()), ctypes.c_void_p(qkv.data_ptr()),
            rope_rows.ctypes.data_as(ctypes.c_void_p), slots.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_void_p(table.data_ptr()), width,
            rows.ctypes.data_as(ctypes.c_void_p) if prompts else None,
            context_lens.ctypes.data_as(ctypes.c_void_p), m, int(prompts),
            ctypes.c_void_p(out.data_ptr()), threads, 0,  # float32 qkv and output
        )  # fmt: skip

    keys = sum(p + t + 1 for p, n in seqs for t in range(n))
    return call, 4.0 * d * h * keys


def alternate(sides: dict[str, Any], repeats: int, run: Callable[[Any], float]) -> dict[str, float]:
    """Median of `run(side)` over `repeats` rounds, the sides' order flipped every round."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for i in range(repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            times[name].append(run(sides[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def kernel_main(libs: dict[str, ctypes.CDLL], args: argparse.Namespace) -> None:
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"one layer's trillm_attention, {args.threads} threads, medians of {args.repeats}")
    for name, (seqs, dtype) in SHAPES.items():
        call, flops = layer_call(seqs, dtype)
        repeats = max(3, args.repeats // 4) if "2048" in name else args.repeats

        def run(lib: ctypes.CDLL, call: Callable[..., None] = call) -> float:
            t0 = clock()
            call(lib, args.threads)
            return clock() - t0

        med = alternate(libs, repeats, run)
        base, new = med["base"] * 1e3, med["new"] * 1e3
        rates = flops / base / 1e6, flops / new / 1e6
        print(f"  {name:20} base {base:8.2f} ms {rates[0]:6.1f} GFLOP/s   new {new:8.2f} ms "
              f"{rates[1]:6.1f} GFLOP/s   new / base {new / base:.3f}")  # fmt: skip


def step_main(libs: dict[str, ctypes.CDLL], args: argparse.Namespace) -> None:
    from model_bench import prompts, trillm_run

    from trillm.default_model import default_model_dir
    from trillm.gpu import Worker, WorkerConfig

    worker = Worker(
        WorkerConfig(str(default_model_dir()), device="cpu", dtype=args.dtype,
                     max_num_seqs=max(8, args.prompts))
    )  # fmt: skip
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(worker.num_available_kv_blocks())
    step = worker.runner.cpu_step
    if step is None:
        raise SystemExit("the runner has no C step here (no compiler?): nothing to compare")
    batch = prompts(args.prompts, args.prompt_len, worker.runner.model_config.vocab_size)
    attend = _cpu_decode.CAttention.attend_qkv
    spent = [0.0]
    clock = time.process_time if args.cpu_time else time.perf_counter

    def attend_timed(self: Any, *a: Any) -> Any:
        t0 = clock()
        try:
            return attend(self, *a)
        finally:
            spent[0] += clock() - t0

    _cpu_decode.CAttention.attend_qkv = attend_timed  # type: ignore[method-assign]
    sides = [*libs, "sdpa"] if args.sdpa else list(libs)
    bound = _cpu_decode.PROMPT_CONTEXT_MAX
    attention: dict[str, list[float]] = {name: [] for name in sides}

    def run(name: str) -> float:
        step.lib = libs.get(name, libs["new"])
        _cpu_decode.PROMPT_CONTEXT_MAX = 0 if name == "sdpa" else 1 << 30
        spent[0] = 0.0
        t0 = clock()
        seconds = trillm_run(worker, batch, 1)[0]
        attention[name].append(spent[0])
        return clock() - t0 if args.cpu_time else seconds

    for name in sides:  # warm-up
        run(name)
    for times in attention.values():
        times.clear()
    med = alternate({name: name for name in sides}, args.step_repeats, run)
    _cpu_decode.PROMPT_CONTEXT_MAX = bound
    print(f"{args.prompts} x {args.prompt_len}-token {args.dtype} prefill step, "
          f"{torch.get_num_threads()} threads, medians of {args.step_repeats} (ms"
          f"{' of CPU time' if args.cpu_time else ''}):")  # fmt: skip
    for name in sides:
        att = statistics.median(attention[name]) * 1e3
        print(f"  {name:5} step {med[name] * 1e3:8.1f}   attention {att:7.1f} "
              f"({att / (med[name] * 1e3):.1%} of the step)")  # fmt: skip
    att_ratio = statistics.median(attention["new"]) / statistics.median(attention["base"])
    print(f"  new / base: step {med['new'] / med['base']:.3f}, attention {att_ratio:.3f}")
    if args.sdpa:
        print(f"  new / sdpa: step {med['new'] / med['sdpa']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision of the baseline kernels")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu-time", action="store_true", help="the process's CPU time")
    p.add_argument("--step", action="store_true", help="the whole prefill step instead")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--step-repeats", type=int, default=5)
    p.add_argument("--sdpa", action="store_true", help="--step: torch's SDPA as a third side")
    p.add_argument("--dtype", default="float32", help="--step: the model's, float32 or bfloat16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    libs = {"base": build_base(args.base), "new": _native.load("cpu_decode")}
    if args.step:
        step_main(libs, args)
    else:
        kernel_main(libs, args)


if __name__ == "__main__":
    main()
