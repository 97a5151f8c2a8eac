"""CPU linear layers: PyTorch's `F.linear` (MKL sgemm) against oneDNN with packed weights.

One "forward" is the linears of every decoder layer of a model shaped like SmolLM2-135M (qkv,
o, gate/up, down; 30 layers, each with its own weights, so they stream from memory as in a real
forward), at M tokens. Best of `--repeats`, interleaved so both see the same machine state.
MKL keeps to AVX2 on AMD CPUs; oneDNN uses AVX-512 where the CPU has it (`lib/gpu/_cpu_linear.py`).

    python perf/linear_bench.py [--tokens 1,32,128] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from trillm.gpu._cpu_linear import pack_weight, packed_linear, packed_linear_available

HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
SHAPES = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]


def forward(
    linear: Callable[..., torch.Tensor], xs: list[torch.Tensor], layers: list[list[torch.Tensor]]
) -> None:
    for layer in layers:
        for x, w in zip(xs, layer, strict=True):
            linear(x, w)


def best_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,32,128")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    print(f"{'dtype':<9} {'M':>4} {'F.linear ms':>12} {'oneDNN ms':>10} {'speed-up':>9} "
          f"{'oneDNN GFLOP/s':>15}")  # fmt: skip
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        if not packed_linear_available(dtype):
            print(f"{dtype}: oneDNN packing is not available here")
            continue
        weights = [[torch.randn(n, k).to(dtype) for k, n in SHAPES] for _ in range(LAYERS)]
        packed = [[pack_weight(w) for w in layer] for layer in weights]
        for m in map(int, args.tokens.split(",")):
            xs = [torch.randn(m, k).to(dtype) for k, _ in SHAPES]

            aten = partial(forward, F.linear, xs, weights)
            onednn = partial(forward, partial(packed_linear, bias=None), xs, packed)
            times: dict[str, float] = {"aten": float("inf"), "onednn": float("inf")}
            for _ in range(3):
                times["aten"] = min(times["aten"], best_ms(aten, args.repeats))
                times["onednn"] = min(times["onednn"], best_ms(onednn, args.repeats))
            flops = 2 * m * LAYERS * sum(k * n for k, n in SHAPES)
            print(
                f"{str(dtype).removeprefix('torch.'):<9} {m:>4} {times['aten']:>12.2f} "
                f"{times['onednn']:>10.2f} {times['aten'] / times['onednn']:>8.2f}x "
                f"{flops / times['onednn'] / 1e6:>15.1f}"
            )


if __name__ == "__main__":
    main()
