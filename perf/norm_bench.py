"""The residual add + RMSNorm of one prefill step's [T, hidden] rows: C's one pass against torch's.

torch's side is what the float32 torch forward ran before `_cpu_ops.CpuNorms`: `x + residual`,
then `F.rms_norm` (passes of its own: pow, mean, rsqrt, mul, mul). C's is
`CpuNorms.add_rms_norm`. The two alternate call by call (the order flipped every pair), so a
loaded machine's drift falls on both; medians and C / torch.

    python perf/norm_bench.py [--tokens 2048] [--hidden 576] [--repeats 41] [--glibc-default-malloc]

Like the engine's worker, it first raises glibc's mmap threshold (`_worker.
keep_activations_in_heap`), so the outputs reuse freed heap pages instead of faulting in fresh
ones each call; `--glibc-default-malloc` does not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trillm.gpu.cpu._cpu_ops import cpu_norms
from trillm.gpu.worker._worker import keep_activations_in_heap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--glibc-default-malloc", action="store_true")
    args = p.parse_args()
    tuned = not args.glibc_default_malloc and keep_activations_in_heap()
    norms = cpu_norms(torch.zeros(1))
    if norms is None:
        raise SystemExit("the C kernels did not build here (no compiler?)")
    x, residual = torch.randn(args.tokens, args.hidden), torch.randn(args.tokens, args.hidden)
    weight = torch.randn(args.hidden)

    def c_side() -> None:
        norms.add_rms_norm(x, residual, weight, 1e-5, 0.0)

    def torch_side() -> None:
        total = x + residual
        F.rms_norm(total, (args.hidden,), weight, 1e-5)

    sides = {"C": c_side, "torch": torch_side}
    times: dict[str, list[float]] = {"C": [], "torch": []}
    for r in range(args.repeats):
        for name in ("C", "torch") if r % 2 == 0 else ("torch", "C"):
            start = time.perf_counter()
            sides[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    c, t = statistics.median(times["C"]), statistics.median(times["torch"])
    malloc = "tuned" if tuned else "default"
    print(f"[{args.tokens}, {args.hidden}] add + RMSNorm, {args.repeats} pairs, "
          f"{torch.get_num_threads()} threads, malloc {malloc}: C {c:.3f} ms, torch {t:.3f} ms, "
          f"C / torch {c / t:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
