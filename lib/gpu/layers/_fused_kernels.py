# mypy: allow-untyped-defs, allow-untyped-decorators, allow-incomplete-defs
"""Fused Triton kernels of the CUDA decode step: residual add + RMSNorm, rotary + KV write,
SiLU * up. Each replaces several torch ops, with each op's rounding kept.

Why: a decode step at batch 1 is launch-bound. The torch forward spends 6 launches on an
RMSNorm (pow, mean, add, rsqrt, mul, mul), 3 on rotary, 2 on SiLU * up and 1 on each residual
add; these kernels make a decoder layer 9 launches instead of 25 (`perf/README.md`). They are
chosen once at load, on CUDA with the triton attention backend (`_kernels.fused_kernels_for`);
the CPU keeps its ops (oneDNN, the C step), so its numbers and speed do not change.

Rounding: each kernel rounds to the model's dtype where the torch ops it replaces do, so in
bfloat16 the outputs are those of the torch modules, bit for bit wherever the float32
arithmetic agrees (the tests compare under the interpreter):
- RMSNorm (Hugging Face): x in float32, x * rsqrt(mean(x^2) + eps), then Llama's order
  `weight * normed.to(dtype)` (two roundings) or, with an offset (Gemma's 1 + w), `(normed *
  (offset + w)).to(dtype)` (one). The residual add `x + residual` rounds to the dtype first,
  as the torch add does; the kernel returns that sum (the next residual) and the normed row.
- Rotary (rotate-half, `_rotary.RotaryEmbedding.rotate`): `x * cos` rounds, then
  `addcmul(that, roll(x), sin)` rounds once.
- SiLU * up: `silu(gate)` rounds, then the product rounds.

Per-step ints (the number of rows) are `do_not_specialize`: Triton would otherwise compile
one variant for 1, one for multiples of 16 and one for the rest, mid-serving. The kernels use
only Triton builtins (see `_triton_kernels`: the interpreter and `triton.language.standard`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import _triton_kernels
from ..attention._attention_triton import TritonAttentionMetadata

_add = _triton_kernels._add  # the interpreter's fast reduction (see `_triton_kernels`)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def _to(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` to nearest even, as torch rounds. bfloat16 by its bits:
    the interpreter's float32 -> bfloat16 cast truncates, and its "rtne" mode rounds half up
    without carrying into the exponent (compiled, the same few integer ops)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit(do_not_specialize=["eps", "offset"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,  # the residual to add first (read only when HAS_RESIDUAL)
    out_ptr,
    res_out_ptr,  # x + residual, the next residual (written only when HAS_RESIDUAL)
    w_ptr,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    offset,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    CAST_FIRST: tl.constexpr,  # Llama's `w * normed.to(dtype)`; else `(normed * (offset + w))`
):
    """One row [r0, r1, :N] of x normed (outputs are contiguous [R0, R1, N])."""
    r0, r1 = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    col = tl.arange(0, N_PAD)
    ok = col < N
    row_out = (r0 * tl.num_programs(1) + r1) * N
    x = tl.load(x_ptr + r0 * stride_x0 + r1 * stride_x1 + col, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + r0 * stride_r0 + r1 * stride_r1 + col, mask=ok, other=0.0)
        x = _to(x.to(tl.float32) + r.to(tl.float32), res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row_out + col, x, mask=ok)
    x32 = x.to(tl.float32)
    mean = tl.reduce(x32 * x32, 0, _add) / N
    normed = x32 * tl.math.rsqrt(mean + eps)
    w = tl.load(w_ptr + col, mask=ok, other=0.0).to(tl.float32)
    if CAST_FIRST:
        y = w * _to(normed, out_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = normed * (w + offset)
    tl.store(out_ptr + row_out + col, _to(y, out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    num_tokens,
    stride_in,
    SIZE: tl.constexpr,  # intermediate size: gate is [:SIZE], up [SIZE:]
    BLOCK: tl.constexpr,
):
    """SiLU(gate) * up of one token's BLOCK columns; grid (tokens, column blocks)."""
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (col < SIZE) & (t < num_tokens)
    g = tl.load(gate_up_ptr + t * stride_in + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + t * stride_in + SIZE + col, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    s = _to(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
    tl.store(out_ptr + t * SIZE + col, _to(s * u, dtype), mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (H + 2 Hkv) D]: q heads, k heads, v heads
    cos_ptr,  # [T, ROT] this step's rows of the table (cos twice)
    sin_ptr,  # [T, ROT] (-sin, sin)
    q_out_ptr,  # [T, H, D]
    k_cache_ptr,  # [blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64, -1: padding, nothing written
    num_tokens,
    stride_qkv,
    stride_cos,
    stride_sin,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROT: tl.constexpr,  # rotated dims (partial rotary: the first ROT of D)
):
    """Program (token, head): a q head rotated into q_out, or a k head rotated and its v head
    copied into their cache slot. A 2-D grid: one token's heads spread over programs."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    col = tl.arange(0, D_PAD)
    ok = (col < D) & (t < num_tokens)
    rot = col < ROT
    partner = tl.where(col < ROT // 2, col + ROT // 2, col - ROT // 2)  # roll by ROT / 2
    row = qkv_ptr + t * stride_qkv + h * D
    x = tl.load(row + col, mask=ok, other=0.0)
    xp = tl.load(row + partner, mask=ok & rot, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_cos + col, mask=ok & rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + col, mask=ok & rot, other=0.0).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    xc = _to(x.to(tl.float32) * cos, dtype).to(tl.float32)
    y = tl.where(rot, _to(xc + xp * sin, dtype), x)
    if h < H:
        tl.store(q_out_ptr + (t * H + h) * D + col, y, mask=ok)
    else:
        slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
        kh = h - H
        keep = ok & (slot >= 0)
        cache = slot * (HKV * D) + kh * D + col
        tl.store(k_cache_ptr + cache, y, mask=keep)
        v = tl.load(row + HKV * D + col, mask=keep, other=0.0)  # v head kh: Hkv heads on
        tl.store(v_cache_ptr + cache, v, mask=keep)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm of x's last dim [..., N] (2-D, or 3-D heads; any row strides, dense rows),
    contiguous. `offset` 0 is Llama's order (`weight * normed.to(dtype)`), else Gemma's."""
    return _norm(x, None, weight, eps, offset)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual) [T, N] in one kernel: the normed input of the
    next block and the next residual."""
    return _norm(x, residual, weight, eps, offset)


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    r3 = x3 if residual is None else residual.view(x3.shape)
    res_out = out if residual is None else torch.empty_like(out)
    if x3.shape[0] and x3.shape[1]:
        _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
            x3, r3, out, res_out, weight, x3.stride(0), x3.stride(1), r3.stride(0),
            r3.stride(1), eps, offset, N=n, N_PAD=_pow2(n), HAS_RESIDUAL=residual is not None,
            CAST_FIRST=not offset and x.dtype != torch.float32,
        )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] in [gate | up] order -> SiLU(gate) * up [T, I], in one kernel."""
    t, width = gate_up.shape
    size = width // 2
    out = torch.empty((t, size), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(size))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(size, block))](
            gate_up, out, t, gate_up.stride(0), SIZE=size, BLOCK=block
        )
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotate q and k of qkv [T, (H + 2 Hkv) D] by `rope` (cos, sin [T, 1, ROT]), store k
    and v at `slots` in the caches; returns the rotated q [T, H, D]."""
    cos, sin = rope
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_write_kv_kernel[(t, num_heads + num_kv_heads)](
            qkv, cos, sin, q, k_cache, v_cache, slots, t, qkv.stride(0), cos.stride(0),
            sin.stride(0), H=num_heads, HKV=num_kv_heads, D=d, D_PAD=_pow2(d), ROT=cos.shape[-1],
        )  # fmt: skip
    return q


class FusedOps:
    """The fused kernels as the model's layers call them (`LlamaForCausalLM.use_fused`)."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    silu_mul = staticmethod(silu_mul)

    @staticmethod
    def rope_attend(
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: object,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        """Rotary and the KV write in one kernel, then the attention kernel: [T, H, D]."""
        if not isinstance(meta, TritonAttentionMetadata):
            raise TypeError(f"fused rotary needs the triton backend's metadata, not {meta!r}")
        q = rope_write_kv(qkv, rope, *kv_cache, meta.slot_mapping, num_heads, num_kv_heads)
        return meta.backend.attention(q, *kv_cache, meta, scale, window, softcap)
