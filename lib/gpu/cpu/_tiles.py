"""trillm's tiled weight layout, the one `csrc/cpu_decode.c` reads, and a linear over it.

Output rows come in tiles of 16; inside a tile the weight is k-major, so the 16 rows' weights
at one k are one 64-byte vector (float32; 32 bytes in bfloat16) and a matrix-vector product
streams each tile once with no horizontal sums. GGUF's Q4_0 / Q4_1 / Q8_0 weights keep their
quants in the same tiles, per group of 32 k (one GGUF block of each of the 16 rows): the
blocks' float16 scales (and minimums) first, then the quants k-major:

    Q4 group  d[16] | m[16] | 16 x 16 bytes: byte r of k-row kk = q[r][kk] | q[r][kk + 16] << 4
    Q8 group  d[16] | 32 x 16 int8
    w = d q + m (Q4_1), d (q - 8) = d q - 8 d (Q4_0: m = -8 d, exact), d q (Q8_0)

That is GGUF's own nibble order, so tiling is a reshuffle of bytes, not a requantization, and
the C kernels apply d and m in float32 to float32 activations: the dequantised model's
arithmetic, to float32 rounding.

`TiledLinear` runs a tiled weight for any batch: the torch forward calls it for GGUF weights
kept quantized (`--quantization gguf`), and the C decode step reads the same tiles, so the
weights are in memory once. Measured on SmolLM2-135M-shaped Q4_1 linears (2 threads,
AVX-512), C tiles against torch's `_weight_int4pack_mm_for_cpu` (bfloat16 activations):
2.30 / 3.30 ms at 1 token, 6.01 / 6.61 at 8, 67.2 / 80.4 at 128, 275 / 327 at 512
(`perf/linear_bench.py --tiled`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from ..quant._gguf_blocks import Q4_0, Q4_1, Q8_0, QuantizedTensor
from . import _native
from ._hugepages import on_huge_pages

F32, BF16, Q4, Q8, BF16_AMX = 0, 1, 2, 3, 4  # the C code's weight types (TL_F32, ...)
DENSE = {torch.float32: F32, torch.bfloat16: BF16}
# bfloat16 weights in AMX tiles where the kernels run their products in hardware (AMX, or
# AVX512_BF16's `vdpbf16ps`: `pairs_ready`); perf tools turn it off to measure the FMA tiles
# against them.
AMX_ENABLED = True


@functools.cache
def tiled_kernels() -> ctypes.CDLL | None:
    """The C kernels, or None where they cannot be built (no compiler: `_native`)."""
    try:
        return _native.load("cpu_decode")
    except _native.NativeBuildError:
        return None


def _padded_rows(n: int, rows: int | None) -> int:
    return -(-max(n, rows or 0) // 16) * 16


def tile(weight: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: 16 output rows per tile, k-major (rows padded with 0,
    to `rows` if that is more)."""
    n, k = weight.shape
    padded = torch.zeros(_padded_rows(n, rows), k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, 16, k).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class Tiles:
    """A weight in the C code's layout: `data` [tiles, bytes or elements of one], `kind`."""

    data: torch.Tensor
    kind: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def interleaved(self) -> Tiles:
        """Gate/up: tile j of the first half next to tile j of the second (2j, 2j + 1)."""
        n = self.data.shape[0]
        pairs = self.data.view(2, n // 2, -1).transpose(0, 1)
        return Tiles(on_huge_pages(pairs.reshape(n, -1).contiguous()), self.kind)


def dense_tiles(weight: torch.Tensor) -> Tiles:
    """A float32 or bfloat16 [N, K] weight as tiles of its dtype."""
    return Tiles(on_huge_pages(tile(weight).flatten(1)), DENSE[weight.dtype])


def amx_ready() -> bool:
    """Whether the C kernels run AMX products here (built for AMX, the tile state granted by
    the kernel: `csrc/tl_amx.h`), and `AMX_ENABLED`."""
    lib = tiled_kernels()
    return AMX_ENABLED and lib is not None and lib.trillm_amx_ready() == 1


def pairs_ready() -> bool:
    """Whether bfloat16 weights go to AMX tiles (`AMX_ENABLED`): where AMX runs their products
    (`amx_ready`), or AVX512_BF16's `vdpbf16ps` does, two products an instruction to the FMA
    tiles' one (AMD Zen 4: 32 decodes' linears 22.9 ms against 43.8, `perf/linear_bench.py
    --tiled --amx`); not where only plain C would read them."""
    return AMX_ENABLED and pair_products() != ""


def pair_products() -> str:
    """What runs the AMX tiles' products here: "AMX", "vdpbf16ps" or "" (none)."""
    lib = tiled_kernels()
    return {2: "AMX", 1: "vdpbf16ps"}.get(lib.trillm_pair_products() if lib else 0, "")


def amx_tiles(weight: torch.Tensor) -> Tiles:
    """A bfloat16 [N, K] weight (K % 32 == 0) as AMX tiles: per tile of 16 rows and chunk of
    32 k, the tile unit's B operand, 16 rows of the 16 outputs' (k = 2r, 2r + 1) pairs."""
    t = tile(weight)  # [T, K, 16]
    n, k = t.shape[0], t.shape[1]
    pairs = t.view(n, k // 32, 16, 2, 16).permute(0, 1, 2, 4, 3)  # [T, chunk, r, out, k % 2]
    return Tiles(on_huge_pages(pairs.reshape(n, -1).contiguous()), BF16_AMX)


def weight_tiles(weight: torch.Tensor, amx: bool) -> Tiles:
    """A dense weight's tiles for the C step: AMX tiles for bfloat16 with `amx` (and K a
    multiple of 32), else `dense_tiles`."""
    if amx and weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0:
        return amx_tiles(weight)
    return dense_tiles(weight)


def quantized_tiles(parts: list[QuantizedTensor], rows: int | None = None) -> Tiles:
    """GGUF weights (the row-wise parts of a merged layer), padded with zero rows to `rows`:
    Q4_0 / Q4_1 parts as Q4, Q8_0 as Q8, a mix of the two dequantised to float32."""
    kinds = {part.qtype for part in parts}
    if kinds <= {Q4_0, Q4_1}:
        fields = [_q4_fields(part) for part in parts]
        d, m, nib = (torch.cat([f[i] for f in fields]) for i in range(3))
        return Tiles(on_huge_pages(_group_tiles(d, [m], nib, kk=16, rows=rows)), Q4)
    if kinds == {Q8_0}:
        blocks = torch.cat([part.blocks for part in parts])
        tiles = _group_tiles(_f16_bits(blocks), [], blocks[:, :, 2:], kk=32, rows=rows)
        return Tiles(on_huge_pages(tiles), Q8)
    dense = torch.cat([part.dequantize() for part in parts])
    return Tiles(on_huge_pages(tile(dense, rows).flatten(1)), F32)


def _f16_bits(blocks: torch.Tensor) -> torch.Tensor:
    """The leading float16 of each [N, G, bytes] block, as int16 bits [N, G]."""
    return blocks[:, :, 0:2].contiguous().view(torch.int16).squeeze(-1)


def _q4_fields(part: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, m as float16 bits [N, G], nibbles [N, G, 16]): w = d q + m (Q4_0: m = -8 d)."""
    blocks = part.blocks
    d = _f16_bits(blocks)
    if part.qtype == Q4_1:
        return d, _f16_bits(blocks[:, :, 2:]), blocks[:, :, 4:]
    m = (d.view(torch.float16).float() * -8).half().view(torch.int16)  # exact: a power of 2
    return d, m, blocks[:, :, 2:]


def _group_tiles(
    d: torch.Tensor, extra: list[torch.Tensor], quants: torch.Tensor, *, kk: int, rows: int | None
) -> torch.Tensor:
    """[T, G * group bytes] uint8: per tile of 16 rows and group g of 32 k, d[16] (and m[16])
    as float16, then the group's quant bytes `quants` [N, G, kk] k-major (kk bytes a row)."""
    n, groups = d.shape
    rows = _padded_rows(n, rows)
    parts = []
    for field in (d, *extra):
        padded = field.new_zeros(rows, groups)
        padded[:n] = field
        parts.append(padded.view(-1, 16, groups).transpose(1, 2).contiguous().view(torch.uint8))
    q = quants.new_zeros(rows, groups, kk)
    q[:n] = quants
    parts.append(q.view(-1, 16, groups, kk).permute(0, 2, 3, 1).reshape(rows // 16, groups, -1))
    return torch.cat(parts, dim=-1).reshape(rows // 16, -1).contiguous()


class TiledLinear:
    """`x @ W.T` over a tiled weight through the C kernel: a `QuantizedLinearWeight`.

    `interleaved` (gate/up): the tiles hold gate tile j next to up tile j, as the C decode
    step fuses them; the output is put back in [gate | up] order for the torch forward.
    """

    def __init__(self, tiles: Tiles, out_features: int, *, interleaved: bool = False) -> None:
        lib = tiled_kernels()
        if lib is None:
            raise _native.NativeBuildError("the C kernels did not build (see the start-up log)")
        self.lib = lib
        self.tiles = tiles.interleaved() if interleaved else tiles
        self.interleaved = interleaved
        self.out_features = out_features
        self.nbytes = self.tiles.nbytes

    @classmethod
    def over(cls, tiles: Tiles, out_features: int, *, interleaved: bool = False) -> TiledLinear:
        """Over `tiles` as they are: with `interleaved`, gate/up tiles already side by side
        (the C step's dense MLP tiles), whose output is put back in [gate | up] order."""
        linear = cls(tiles, out_features)
        linear.interleaved = interleaved
        return linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, x.shape[-1]).float().contiguous()
        m, n = a.shape[0], self.out_features
        out = torch.empty(m, n, dtype=torch.float32)
        if m and self.lib.trillm_linear(
            ctypes.c_void_p(self.tiles.data.data_ptr()),
            self.tiles.kind,
            a.shape[1],
            n,
            ctypes.c_void_p(a.data_ptr()),
            m,
            ctypes.c_void_p(out.data_ptr()),
            torch.get_num_threads(),
        ):
            raise MemoryError(f"no memory for the group sums of {m} rows (trillm_linear)")
        if self.interleaved:  # [m, tiles/2, 2, 16] -> [m, 2, tiles/2, 16]
            out = out.view(m, -1, 2, 16).transpose(1, 2).reshape(m, n)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
