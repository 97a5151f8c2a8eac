"""The torch forward's bfloat16 element-wise C kernels, this tree's build against a revision's.

SiLU(gate) * up over [T, 2 x 1536] and the residual add + RMSNorm over [T, 576] (SmolLM2's
prefill shapes, `_cpu_ops`), each called through this tree's `csrc` build and through a build
of `--base` (default HEAD; `prompt_attention_bench.build_base`), alternated call by call (the
order flipped every pair) on one thread, timed by the process's CPU time so a busy machine's
other work counts less. Prints medians, new / base, and whether the outputs are bit-identical.

    python perf/elementwise_bench.py [--base REV] [--tokens 2048] [--repeats 41]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch
from prompt_attention_bench import build_base

from trillm.gpu.cpu._tiles import tiled_kernels
from trillm.gpu.worker._worker import keep_activations_in_heap

HIDDEN, INTERMEDIATE = 576, 1536


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=41)
    args = p.parse_args()
    keep_activations_in_heap()  # as the worker: outputs reuse freed heap pages
    torch.set_num_threads(1)
    new = tiled_kernels()
    if new is None:
        raise SystemExit("the C kernels did not build here (no compiler?)")
    libs = {"base": build_base(args.base), "new": new}
    t = args.tokens
    torch.manual_seed(0)
    gate_up = (torch.randn(t, 2 * INTERMEDIATE) * 4).bfloat16()
    x, residual = torch.randn(t, HIDDEN).bfloat16(), torch.randn(t, HIDDEN).bfloat16()
    scale = torch.randn(HIDDEN)

    def ptr(a: torch.Tensor) -> ctypes.c_void_p:
        return ctypes.c_void_p(a.data_ptr())

    def silu(lib: ctypes.CDLL) -> list[torch.Tensor]:
        out = torch.empty(t, INTERMEDIATE, dtype=torch.bfloat16)
        lib.trillm_silu_mul_bf16(ptr(gate_up), ctypes.c_int64(t), INTERMEDIATE, ptr(out), 1)
        return [out]

    def norm(lib: ctypes.CDLL) -> list[torch.Tensor]:
        out, total = torch.empty_like(x), torch.empty_like(x)
        lib.trillm_add_rms_norm_bf16(
            ptr(x), ptr(residual), ptr(scale), ctypes.c_int64(t), HIDDEN,
            ctypes.c_float(1e-5), 1, ptr(out), ptr(total), 1,
        )  # fmt: skip
        return [out, total]

    kernels: dict[str, Callable[[ctypes.CDLL], list[torch.Tensor]]] = {
        f"SiLU * up [{t}, 2 x {INTERMEDIATE}]": silu,
        f"add + RMSNorm [{t}, {HIDDEN}]": norm,
    }
    for name, kernel in kernels.items():
        pairs = zip(kernel(libs["base"]), kernel(libs["new"]), strict=True)
        same = all(torch.equal(a, b) for a, b in pairs)
        times: dict[str, list[float]] = {side: [] for side in libs}
        for i in range(args.repeats):
            for side in ("base", "new") if i % 2 == 0 else ("new", "base"):
                t0 = time.process_time()
                kernel(libs[side])
                times[side].append(time.process_time() - t0)
        base, mine = (statistics.median(times[s]) * 1e3 for s in ("base", "new"))
        print(f"{name:32} base {base:7.3f} ms   new {mine:7.3f} ms   new / base "
              f"{mine / base:.3f}   identical: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
