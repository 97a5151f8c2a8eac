# mypy: allow-untyped-defs, allow-untyped-decorators, allow-incomplete-defs
"""Triton kernels of the paged attention backend: the KV write and one attention kernel.

The attention kernel follows vLLM's `triton_unified_attention` design. One program takes a
*query block* (up to BLOCK_Q consecutive query tokens of one sequence, times the QPK query
heads that share one KV head, so BLOCK_M = BLOCK_Q * QPK rows padded to a power of two) and
walks that sequence's paged KV in tiles, with an online softmax. Prefill chunks, whole
prompts and decodes are the same case: a query token at position p sees keys 0..p, or with a
sliding window W only keys p - W < j <= p. Grid: (query blocks of the whole batch, KV heads,
segments). With one segment it writes the output; with more (long decodes at a small batch,
where query blocks x heads leave the GPU idle) each segment covers a slice of the tiles and
writes its unnormalised partial sums, max and denominator, and `_reduce_segments_kernel`
merges them.

A block's tiles run from the one holding the first key its earliest query sees (tile 0
without a window) to the one holding its last query's position; tiles wholly before the
window are never loaded, and segments split only that range. Soft-capping (Gemma 2) replaces
each score s by cap * tanh(s / cap) before the mask. SLIDING and SOFTCAP are constexpr flags
(the window and the cap themselves are runtime values): with both off the kernel compiles to
the same instructions as before they existed, and a layer's values, fixed per call, are baked
into a captured CUDA graph like any other argument.

Off CUDA the kernels run in Triton's interpreter (numpy on CPU tensors, for correctness).
TRITON_INTERPRET must be set before `triton` is imported, so it is set here, at import, when
no GPU is present. The interpreter's bf16 `tl.dot` is wrong, so FP32_DOT casts inside the
kernel; fp32 on a GPU also asks for IEEE products (Triton would use TF32). The kernels call
only Triton's builtins, never `triton.language.standard`'s jit functions (`tl.max`,
`tl.sum`, `tl.cdiv`, `tl.zeros`) themselves: those were made when `triton` was first
imported, which in a process that loaded transformers' Llama (it imports triton) happened
before TRITON_INTERPRET was set, so under the interpreter they refuse to run.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _interpreter_scalar_index() -> None:
    """Let the interpreter loop over `range(lo, hi)` with loaded (tensor) bounds on NumPy 2.

    Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop
    bounds with `int(array)`, which NumPy >= 2.3 refuses for arrays that are not 0-d
    ("only 0-dimensional arrays can be converted to Python scalars"). Compiled kernels are
    untouched; this only replaces the interpreter's `__index__` with one that takes `.item()`.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "trillm_patched", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch.trillm_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch


if INTERPRETED:
    _interpreter_scalar_index()


# Reductions go through `tl.reduce` with the standard library's own combine functions: the
# interpreter recognises exactly these (by identity) and reduces with numpy; with any other
# combine function it calls it element by element (about 80x slower here).
_max = tl.standard._elementwise_max
_add = tl.standard._sum_combine


@triton.jit(do_not_specialize=["num_tokens"])  # a per-step int: no compile mid-serving
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_k,  # token stride of k [T, Hkv, D] (its heads and dims are contiguous)
    stride_v,
    ROW: tl.constexpr,  # Hkv * D: one token's K (or V) row
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,  # columns of the row per program
):
    """K and V of BLOCK_T tokens x BLOCK_C columns of their rows to the tokens' cache slots;
    a slot of -1 (padding) is skipped. Grid (token blocks, column blocks): the tile stays
    BLOCK_T x BLOCK_C however wide Hkv * D is (a tile of whole rows, next_pow2(Hkv * D)
    wide, would spill registers for wide multi-head models: issue 29's reading of the code,
    unmeasured), and a small batch's rows spread over several programs."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (col < ROW)[None, :]
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t64 * stride_k + col[None, :], mask=ok)
    v = tl.load(v_ptr + t64 * stride_v + col[None, :], mask=ok)
    tl.store(k_cache_ptr + slot[:, None] * ROW + col[None, :], k, mask=ok)
    tl.store(v_cache_ptr + slot[:, None] * ROW + col[None, :], v, mask=ok)


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), from exp(-2|x|) in (0, 1]: finite for any score (the interpreter
    has no libdevice tanh, and exp(x) - exp(-x) overflows to inf / inf past |x| = 88)."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


# The block table's row stride is the step's table width on the eager path (1 block, then 3,
# ...: a new variant each time Triton's key for it changes, mid-serving); the window is a
# layer's, unspecialised so that no model's value (1, a multiple of 16) makes one variant more.
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _attention_kernel(
    out_ptr,  # [T, H, D], or the segment buffers' owner when NUM_SEGMENTS > 1
    segm_out_ptr,  # [T, H, NUM_SEGMENTS, D] float32 (unused with one segment)
    segm_max_ptr,  # [T, H, NUM_SEGMENTS] float32
    segm_sum_ptr,  # [T, H, NUM_SEGMENTS] float32
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [S, width] int32
    seq_lens_ptr,  # [S] int32: context after this step (0: a padding row)
    query_start_ptr,  # [S + 1] int32: cumulative query tokens
    qblock_seq_ptr,  # [num query blocks] int32: the sequence of each query block
    qblock_first_ptr,  # [num query blocks] int32: its first query token within the sequence
    scale,
    window,  # keys a query sees, itself included (read only when SLIDING)
    softcap,  # the cap of the scores (read only when SOFTCAP)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    QPK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    qblock = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = tl.load(qblock_seq_ptr + qblock)
    first = tl.load(qblock_first_ptr + qblock)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    before = seq_len - q_len  # context computed in earlier steps

    m = tl.arange(0, BLOCK_M)
    q_tok = first + m // QPK
    head = kv_head * QPK + m % QPK
    row_ok = (m < BLOCK_Q * QPK) & (q_tok < q_len)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    token = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = before + q_tok

    # Keys this block can see end at its last query's position and, with a window, start
    # at the first key its earliest query sees; split the tiles between them by segment.
    kv_end = tl.minimum(seq_len, before + first + BLOCK_Q)
    tile_end = (kv_end + TILE - 1) // TILE
    tile_start = tl.maximum(before + first - window + 1, 0) // TILE if SLIDING else 0
    per_segment = (tile_end - tile_start + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    tile_lo = tile_start + segment * per_segment
    tile_hi = tl.minimum(tile_lo + per_segment, tile_end)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    offs = tl.arange(0, TILE)
    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE + offs
        k_ok = k_pos < kv_end
        block = tl.load(
            block_tables_ptr + seq.to(tl.int64) * stride_bt + k_pos // BLOCK_SIZE,
            mask=k_ok,
            other=0,
        ).to(tl.int64)
        base = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if SOFTCAP:
            s = _softcap(s, softcap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if SLIDING:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.reduce(s, 1, _max))
        new_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing visible yet
        p = tl.exp(s - new_max[:, None])
        alpha = tl.exp(row_max - new_max)
        row_sum = row_sum * alpha + tl.reduce(p, 1, _add)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        row_max = new_max

    store_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        slot = (token * (QPK * tl.num_programs(1)) + head) * NUM_SEGMENTS + segment
        tl.store(segm_out_ptr + slot[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=store_mask)
        tl.store(segm_max_ptr + slot, row_max, mask=row_ok)
        tl.store(segm_sum_ptr + slot, row_sum, mask=row_ok)


@triton.jit
def _reduce_segments_kernel(
    out_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Merge one (token, head)'s segments: rescale each to the common max and normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seg = tl.arange(0, NUM_SEGMENTS)
    slot = (token * num_heads + head) * NUM_SEGMENTS + seg
    seg_max = tl.load(segm_max_ptr + slot)
    top = tl.reduce(seg_max, 0, _max)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(seg_max - top)
    total = tl.reduce(tl.load(segm_sum_ptr + slot) * weight, 0, _add)
    d = tl.arange(0, HEAD_DIM_PAD)
    parts = tl.load(segm_out_ptr + slot[:, None] * HEAD_DIM_PAD + d[None, :])
    out = tl.reduce(parts * weight[:, None], 0, _add) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )
