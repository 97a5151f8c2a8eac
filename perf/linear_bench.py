"""CPU linear layers: PyTorch's `F.linear` (MKL sgemm) against oneDNN with packed weights.

One "forward" is the linears of every decoder layer of a model shaped like SmolLM2-135M (qkv,
o, gate/up, down; 30 layers, each with its own weights, so they stream from memory as in a real
forward), at M tokens. Best of `--repeats`, interleaved so both see the same machine state.
MKL keeps to AVX2 on AMD CPUs; oneDNN uses AVX-512 where the CPU has it
(`lib/gpu/cpu/_cpu_linear.py`).

    python perf/linear_bench.py [--tokens 1,32,128] [--dtypes float32,bfloat16]
    python perf/linear_bench.py --tiled [--tokens 1,8,32,128,512] [--threads 1 --cpu-time]
    python perf/linear_bench.py --tiled --amx [--tokens 1,16,32,64]   (bfloat16)
    python perf/linear_bench.py --tiled [--amx] --base REV

`--base REV` adds each C kernel built from git revision REV's `lib/gpu/cpu/csrc`
(`prompt_attention_bench.build_base`) as a column of its own ("...@base"), interleaved with
this tree's: a before/after of a kernel change in one process, on the same machine state.

`--tiled` times trillm's C tiles (`lib/gpu/cpu/_tiles.py`) the same way: float32 tiles against
oneDNN's packed float32, and the weights as GGUF Q4_1 blocks in C tiles (float32 activations)
against torch's int4 kernel over the same nibbles (`_weight_int4pack_mm_for_cpu`, bfloat16
activations: what `--quantization gguf` ran before the tiles).

On a busy machine two threads wait for each other while other work holds the cores, and wall
times mean little: `--threads 1 --cpu-time` times one thread by the process's CPU time.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from trillm.gpu.cpu._cpu_linear import pack_weight, packed_linear, packed_linear_available
from trillm.gpu.quant._gguf_blocks import BLOCK_BYTES, Q4_1, QuantizedTensor

HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
SHAPES = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]


def forward(
    linear: Callable[..., torch.Tensor], xs: list[torch.Tensor], layers: list[list[torch.Tensor]]
) -> None:
    for layer in layers:
        for x, w in zip(xs, layer, strict=True):
            linear(x, w)


def best_ms(
    run: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        run()
        best = min(best, clock() - t0)
    return best * 1e3


def tiled_main(args: argparse.Namespace) -> None:
    """C tiles against oneDNN (float32) and against torch's int4 kernel (Q4_1), best ms."""
    from trillm.gpu.cpu._tiles import TiledLinear, dense_tiles, quantized_tiles, tiled_kernels
    from trillm.gpu.quant._quantized import Int4Weight

    if tiled_kernels() is None:
        raise SystemExit("linear_bench: the C kernels do not build here (no C compiler?)")
    weights = [[torch.randn(n, k) * 0.05 for k, n in SHAPES] for _ in range(LAYERS)]
    kernels: dict[str, list[list[Callable[[torch.Tensor], torch.Tensor]]]]
    if args.amx:
        tiled_runs(args, with_base(args, amx_kernels(weights)), torch.bfloat16)
        return
    q4 = [[gguf_blocks(w) for w in layer] for layer in weights]
    kernels = {
        "onednn_f32": [
            [partial(packed_linear, packed=pack_weight(w), bias=None) for w in layer]
            for layer in weights
        ],
        "c_f32": [[TiledLinear(dense_tiles(w), w.shape[0]) for w in layer] for layer in weights],
        "int4_bf16": [[Int4Weight([q], q.shape[0]) for q in layer] for layer in q4],
        "c_q4_1": [[TiledLinear(quantized_tiles([q]), q.shape[0]) for q in layer] for layer in q4],
    }
    tiled_runs(args, with_base(args, kernels), torch.float32)


def with_base(
    args: argparse.Namespace, kernels: dict[str, list[list[Callable[[torch.Tensor], torch.Tensor]]]]
) -> dict[str, list[list[Callable[[torch.Tensor], torch.Tensor]]]]:
    """`kernels`, and with `--base` each C kernel again on REV's build (same weights)."""
    from prompt_attention_bench import build_base

    from trillm.gpu.cpu._tiles import TiledLinear

    if not args.base:
        return kernels
    lib = build_base(args.base)
    out = dict(kernels)
    for name, layers in kernels.items():
        if not all(isinstance(f, TiledLinear) for layer in layers for f in layer):
            continue
        based = [[copy.copy(f) for f in layer] for layer in layers]
        for layer in based:
            for f in layer:
                f.lib = lib
        out[f"{name}@base"] = based
    return out


def amx_kernels(
    weights: list[list[torch.Tensor]],
) -> dict[str, list[list[Callable[[torch.Tensor], torch.Tensor]]]]:
    """bfloat16: oneDNN's packed linears (AMX where the CPU has it) against the C step's FMA
    tiles and its AMX tiles (`csrc/tl_amx.h`: AMX, or AVX512_BF16's `vdpbf16ps`)."""
    from trillm.gpu.cpu._tiles import (
        TiledLinear,
        amx_tiles,
        dense_tiles,
        pair_products,
        pairs_ready,
    )

    if not pairs_ready():
        raise SystemExit("linear_bench --amx: no AMX or vdpbf16ps products here (pairs_ready)")
    print(f"linear_bench --amx: the AMX tiles' products run on {pair_products()}")
    bf16 = [[w.bfloat16() for w in layer] for layer in weights]
    return {
        "onednn_bf16": [
            [partial(packed_linear, packed=pack_weight(w), bias=None) for w in layer]
            for layer in bf16
        ],
        "c_bf16_fma": [[TiledLinear(dense_tiles(w), w.shape[0]) for w in layer] for layer in bf16],
        "c_bf16_amx": [[TiledLinear(amx_tiles(w), w.shape[0]) for w in layer] for layer in bf16],
    }


def tiled_runs(
    args: argparse.Namespace,
    kernels: dict[str, list[list[Callable[[torch.Tensor], torch.Tensor]]]],
    dtype: torch.dtype,
) -> None:
    """Each kernel's best ms of a forward at each M, the kernels interleaved."""
    clock = time.process_time if args.cpu_time else time.perf_counter
    what = "CPU" if args.cpu_time else "wall"
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; best {what} ms of a forward")
    print(f"{'M':>4} " + " ".join(f"{name:>11}" for name in kernels))
    for m in map(int, args.tokens.split(",")):
        xs = [torch.randn(m, k).to(dtype) for k, _ in SHAPES]
        runs = {name: partial(forward, _call, xs, layers) for name, layers in kernels.items()}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(3):  # interleaved: every kernel sees the same machine state
            for name, run in runs.items():
                best[name] = min(best[name], best_ms(run, args.repeats, clock))
        print(f"{m:>4} " + " ".join(f"{best[name]:>11.2f}" for name in kernels), flush=True)


def _call(x: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return linear(x)


def gguf_blocks(w: torch.Tensor, qtype: int = Q4_1) -> QuantizedTensor:
    """`w` quantized to GGUF blocks of `qtype` (gguf's own quantizer)."""
    import gguf

    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(qtype))
    n, k = w.shape
    blocks = torch.from_numpy(raw.reshape(n, k // 32, BLOCK_BYTES[qtype]).copy())
    return QuantizedTensor(qtype, blocks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,32,128")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tiled", action="store_true", help="trillm's C tiles (see above)")
    p.add_argument(
        "--amx", action="store_true",
        help="--tiled in bfloat16: oneDNN, the C FMA tiles and the C AMX tiles",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="--tiled: torch threads (0: as is)")
    p.add_argument("--cpu-time", action="store_true", help="--tiled: process CPU time")
    p.add_argument("--base", default="", help="--tiled: also the C kernels of git revision REV")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiled:
        tiled_main(args)
        return
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
