"""Weight-only quantized linears on the CPU: GGUF's Q4_0 / Q4_1 / Q8_0 weights kept compact.

`--quantization gguf` keeps a GGUF file's block-quantized weights in memory near their file
size. Where this machine builds trillm's C kernels (`_native`: a C compiler), the blocks go
into C tiles (`_tiles`: GGUF's bytes reshuffled, float32 activations, the dequantised model's
arithmetic) that the torch forward and the C decode step (`_cpu_decode`) both read: faster
than the torch kernels below at every batch size measured, and more exact. Elsewhere they are
multiplied with torch's CPU kernels:

- **Q4_0 / Q4_1 -> int4** (`aten._weight_int4pack_mm_for_cpu`: int4 weights in groups of 32
  along the input, one scale and one zero per group; bfloat16 activations, float32
  accumulation, bfloat16 output). GGUF's blocks are that kernel's groups:

      kernel  w = (q4 - 8) * scale + zero      q4 in 0..15
      Q4_0    w = d * (q - 8)         ->  q4 = q, scale = d, zero = 0
      Q4_1    w = d * q + m           ->  q4 = q, scale = d, zero = m + 8 d

  The nibbles are kept exactly; the float16 `d` and `zero` are rounded to bfloat16 (8
  significant bits: relative error <= 2^-8 each), and activations and outputs are bfloat16
  (2^-8 each too), because the kernel's float32-activation path is scalar: 8-14x slower than
  the float32 oneDNN linear at one token (`perf/model_bench.py --kernels`).
- **Q8_0 -> float16** (`quantized.linear_dynamic_fp16`, fbgemm: float16 weights, float32
  activations, accumulation and output): each block is dequantised to float32 and rounded to
  float16 (`d * q` has up to 19 significant bits, float16 keeps 11: relative error <= 2^-11),
  2 bytes a weight instead of 1.06. Q8_0 is the embedding and tied head of SmolLM2's Q4_1
  file. The alternatives were measured and are worse: `_weight_int8pack_mm` has one scale per
  output row, so the per-block scales would have to be requantized (an error as large as
  Q8_0's own); splitting q = 16 hi + lo into two int4 halves is exact in the weights, but the
  head's output is then bfloat16, a 0.125 step at SmolLM2's logits of 16-32, and greedy tokens
  parted from the dequantized model's in 5 of 8 test prompts (2 of 8 with this head).

A merged layer (q/k/v, gate/up) whose parts are all Q4 runs int4; one with a Q8_0 part runs
float16. `perf/model_bench.py --quantization none,gguf` measures the time;
`tests/gpu/test_quantized.py` bounds the error in logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from ..cpu._tiles import TiledLinear, quantized_tiles, tiled_kernels
from ._gguf_blocks import BLOCK_SIZE, Q4_0, Q4_1, Q8_0, QuantizedTensor

_ROWS = 16  # the int4 packer's row granularity (`expect N to be dividable by 16`)


class QuantizationUnsupportedError(RuntimeError):
    """`quantization="gguf"` was asked for where its kernels cannot run."""


def choose_quantization(resolved: str, device: torch.device) -> tuple[str, str]:
    """(quantization in use, why) for `WorkerConfig.quantization_for`'s answer `resolved`.

    Raises:
        QuantizationUnsupportedError: "gguf" on a device or torch build without the kernels.
    """
    if resolved == "none":
        return "none", ""
    why = ""
    if device.type != "cpu":
        why = f"its kernels are torch's CPU ones, and the model is on {device}"
    elif not quantized_kernels_run():
        why = "this torch build's int4 or fbgemm float16 kernel did not run a test weight"
    if why:
        raise QuantizationUnsupportedError(
            f"quantization='gguf' cannot run: {why}; use quantization 'none' (--quantization "
            f"none) to dequantise the weights"
        )
    if tiled_kernels() is not None:
        return "gguf", "Q4_0/Q4_1/Q8_0 blocks in C tiles, float32 activations"
    return "gguf", "Q4_0/Q4_1 as int4 with bfloat16 activations, Q8_0 as float16"


class QuantizedLinearWeight(Protocol):
    """`x @ W.T` for a weight packed out of GGUF's blocks (`pack_quantized`); `nbytes` it holds."""

    nbytes: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def pack_quantized(
    parts: Sequence[QuantizedTensor], *, rows: int | None = None, interleaved: bool = False
) -> QuantizedLinearWeight:
    """The row-wise concatenation of `parts` (merged q/k/v or gate/up, all [*, K]), padded
    with zero rows to `rows` outputs (a vocabulary shard's padding), packed for its kernel:
    trillm's C tiles (`_tiles`) where they build, else torch's int4 or fbgemm float16.

    Args:
        interleaved: gate/up (two equal parts, a multiple of 16 rows each): tiles in the
            order the C decode step fuses them (`TiledLinear`).

    Raises:
        ValueError: the parts' widths differ.
    """
    if len({part.shape[1] for part in parts}) != 1:
        raise ValueError(f"merged parts of different widths: {[p.shape for p in parts]}")
    total = sum(part.shape[0] for part in parts)
    rows = total if rows is None else rows
    if tiled_kernels() is not None:
        tiles = quantized_tiles(list(parts), rows)
        return TiledLinear(tiles, rows, interleaved=interleaved)
    if any(part.qtype == Q8_0 for part in parts):
        return Float16Weight(parts, rows)
    return Int4Weight(parts, rows)


class Int4Weight:
    """Q4_0 / Q4_1 parts packed for `_weight_int4pack_mm_for_cpu` (groups of 32)."""

    def __init__(self, parts: Sequence[QuantizedTensor], rows: int) -> None:
        groups = [_int4_groups(part) for part in parts]
        q = torch.cat([g[0] for g in groups])
        scale = torch.cat([g[1] for g in groups])
        zero = torch.cat([g[2] for g in groups])
        pad = rows - q.shape[0] + -rows % _ROWS
        if pad:  # zero rows (q4 = 8, scale = zero = 0), cut off the output again
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # The kernel reads scales and zeros as [groups, rows, 2].
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1)
        self.scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous()
        self.out_features = rows
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.packed, scales_and_zeros))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            a, self.packed, BLOCK_SIZE, self.scales_and_zeros
        )
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Float16Weight:
    """Parts dequantised and packed as float16 for fbgemm's `linear_dynamic_fp16`."""

    def __init__(self, parts: Sequence[QuantizedTensor], rows: int) -> None:
        weight = torch.zeros(rows, parts[0].shape[1])
        start = 0
        for part in parts:
            weight[start : start + part.shape[0]] = part.dequantize()
            start += part.shape[0]
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        self.out_features = rows
        self.nbytes = weight.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)
        return out.to(x.dtype)


def _int4_groups(part: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q4 uint8 [N, K], scale [N, K/32], zero [N, K/32] float32) for one Q4 part's blocks."""
    if part.qtype not in (Q4_0, Q4_1):
        raise ValueError(f"{part.type_name} weights do not fit the int4 kernel (Q4_0, Q4_1 do)")
    blocks = part.blocks
    n, g, _ = blocks.shape
    d = _float16(blocks[:, :, 0:2])
    nibbles = blocks[:, :, 4:] if part.qtype == Q4_1 else blocks[:, :, 2:]
    q4 = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, g * BLOCK_SIZE)
    zero = _float16(blocks[:, :, 2:4]) + 8 * d if part.qtype == Q4_1 else torch.zeros_like(d)
    return q4, d, zero


def _float16(pairs: torch.Tensor) -> torch.Tensor:
    """[N, G, 2] uint8 little-endian float16 bytes -> [N, G] float32."""
    return pairs.contiguous().view(torch.float16).squeeze(-1).float()


@functools.cache
def quantized_kernels_run() -> bool:
    """The kernels `pack_quantized` picks run here and give the dequantized answer on a tiny
    weight (probed once per process: a torch build without fbgemm, or without the int4 CPU
    kernel, has not, if it is torch's kernels that were picked)."""
    blocks = torch.zeros(_ROWS, 1, 18, dtype=torch.uint8)
    blocks[:, :, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    blocks[:, :, 2:] = 0x99  # every weight q = 9: w = 1 * (9 - 8) = 1
    q8 = torch.zeros(_ROWS, 1, 34, dtype=torch.uint8)
    q8[:, :, 0:2] = blocks[:, :, 0:2]
    q8[:, :, 2:] = 1  # w = 1 * 1
    x = torch.ones(2, BLOCK_SIZE)
    try:
        outs = [pack_quantized([QuantizedTensor(t, b)])(x) for t, b in ((Q4_0, blocks), (Q8_0, q8))]
    except (RuntimeError, AttributeError):
        return False
    return all(bool((out == BLOCK_SIZE).all()) for out in outs)
