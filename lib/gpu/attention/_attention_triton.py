"""The `triton` attention backend: one kernel for a whole mixed batch over the paged cache.

The host side of `_triton_kernels`: per step it builds the flat arrays the kernel reads
(sequence lengths, query start offsets, block tables, and which sequence each query block
belongs to) with numpy, uploads them once, and every layer launches the same two kernels (KV
write, attention). Nothing in a launch reads a device value on the host, so a decode step can
be captured in a CUDA graph (`_cuda_graphs`) over static copies of these arrays.

Tile sizes: on a GPU, BLOCK_M = 16 query rows (tl.dot's minimum) and tiles of 32 keys; under
the interpreter every program costs about a millisecond of Python whatever its size, so
programs are made large instead (64 rows, 128-key tiles, 128-token KV writes). The KV write
takes 16 tokens x 256 columns of a token's Hkv * D row per program on a GPU (128 x 1024 under
the interpreter), over a grid of token blocks x column blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import _triton_kernels as kernels

MAX_SEGMENTS = 16  # split-KV segments for long decodes at a small batch
_SM_FALLBACK = 132


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """A step's kernel inputs, shared by every layer (device tensors and launch sizes)."""

    slot_mapping: torch.Tensor  # [T] int64, -1 for padding rows
    seq_lens: torch.Tensor  # [S] int32
    query_start: torch.Tensor  # [S + 1] int32
    block_tables: torch.Tensor  # [S, width] int32
    qblock_seq: torch.Tensor  # [Q] int32
    qblock_first: torch.Tensor  # [Q] int32
    num_segments: int
    backend: TritonAttention

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend q [T, H, D]; returns [T, H, D].

        `window` > 0: each query sees only the last `window` keys, itself included.
        `softcap` > 0: scores become softcap * tanh(score / softcap) before the softmax.
        """
        return self.backend.forward(q, k, v, k_cache, v_cache, self, scale, window, softcap)


class TritonAttention:
    """Launch parameters for one model's heads, and the per-step metadata builder."""

    name = "triton"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        device: torch.device,
        *,
        num_segments: int | None = None,
    ) -> None:
        """`num_segments` forces the split-KV segment count (tests); None chooses per step."""
        if num_segments is not None and (num_segments < 1 or num_segments & (num_segments - 1)):
            raise ValueError(f"num_segments must be a power of two, got {num_segments}")
        self.num_kv_heads = num_kv_heads
        self.qpk = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.head_dim_pad = max(16, _pow2(head_dim))
        self.block_size = block_size
        self.device = device
        self.interpreted = kernels.INTERPRETED
        rows = 64 if self.interpreted else 16
        self.block_m = max(rows, _pow2(self.qpk))
        self.block_q = self.block_m // self.qpk
        self.tile = 128 if self.interpreted else 32
        self.write_tokens = 128 if self.interpreted else 16
        self.write_cols = 1024 if self.interpreted else 256  # of Hkv * D per write program
        self.forced_segments = num_segments
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else _SM_FALLBACK
        )

    def describe(self) -> str:
        mode = "interpreted on CPU: correctness only, slow" if self.interpreted else "compiled"
        return f"attention triton ({mode})"

    def segments_for(self, num_seqs: int, max_query_len: int) -> int:
        """Split the keys only for decode-only steps that leave most SMs idle (on a GPU: the
        interpreter runs programs one by one, so more of them only cost time)."""
        if self.forced_segments is not None:
            return self.forced_segments
        if self.interpreted or max_query_len > 1 or num_seqs * self.num_kv_heads >= self.num_sms:
            return 1
        return MAX_SEGMENTS

    def query_blocks(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sequence, first query token) of each query block, for query lengths `counts`."""
        per_seq = -(-counts.astype(np.int64) // self.block_q)
        seq = np.repeat(np.arange(len(counts), dtype=np.int32), per_seq)
        starts = np.cumsum(per_seq) - per_seq
        first = (np.arange(int(per_seq.sum())) - np.repeat(starts, per_seq)) * self.block_q
        return seq, first.astype(np.int32)

    def metadata(
        self,
        counts: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        slots: np.ndarray,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> TritonAttentionMetadata:
        """Per-step inputs from the scheduled sequences' query lengths, contexts and tables."""
        query_start = np.zeros(len(counts) + 1, np.int32)
        np.cumsum(counts, out=query_start[1:])
        seq, first = self.query_blocks(counts)
        return TritonAttentionMetadata(
            slot_mapping=upload(slots.astype(np.int64, copy=False)),
            seq_lens=upload(context_lens.astype(np.int32)),
            query_start=upload(query_start),
            block_tables=upload(np.ascontiguousarray(block_tables, np.int32)),
            qblock_seq=upload(seq),
            qblock_first=upload(first),
            num_segments=self.segments_for(len(counts), int(counts.max(initial=0))),
            backend=self,
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Store K/V [T, Hkv, D] at `slots` (one kernel for both; -1 slots are skipped)."""
        num_tokens = k.shape[0]
        if num_tokens == 0:
            return
        _check_rows(k, v)
        row = k.shape[1] * k.shape[2]
        cols = min(_pow2(row), self.write_cols)
        grid = (triton_cdiv(num_tokens, self.write_tokens), triton_cdiv(row, cols))
        kernels._write_kv_kernel[grid](
            k, v, k_cache, v_cache, slots, num_tokens, k.stride(0), v.stride(0),
            ROW=row, BLOCK_T=self.write_tokens, BLOCK_C=cols,
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """The KV write and the attention of one layer (`window`, `softcap`: as in `attend`).

        Raises:
            ValueError: `window` or `softcap` is negative.
        """
        _check_window_softcap(window, softcap)  # before anything is written
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attention(q, k_cache, v_cache, meta, scale, window, softcap)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """The attention of one layer over K/V already in the cache (`forward` without its
        write; the fused rotary kernel writes K/V itself, `_fused_kernels`).

        Raises:
            ValueError: `window` or `softcap` is negative.
        """
        _check_window_softcap(window, softcap)
        num_tokens, num_heads = q.shape[0], q.shape[1]
        out = torch.empty_like(q)
        segments = meta.num_segments
        if segments > 1:
            segm_out = torch.empty(
                (num_tokens, num_heads, segments, self.head_dim_pad),
                dtype=torch.float32,
                device=q.device,
            )
            segm_max = torch.empty(
                (num_tokens, num_heads, segments), dtype=torch.float32, device=q.device
            )
            segm_sum = torch.empty_like(segm_max)
        else:
            segm_out = segm_max = segm_sum = out  # not read with one segment
        grid = (meta.qblock_seq.shape[0], self.num_kv_heads, segments)
        kernels._attention_kernel[grid](
            out, segm_out, segm_max, segm_sum, q, k_cache, v_cache,
            meta.block_tables, meta.seq_lens, meta.query_start, meta.qblock_seq,
            meta.qblock_first, scale, window, softcap,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            QPK=self.qpk, BLOCK_Q=self.block_q, BLOCK_M=self.block_m,
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self.head_dim_pad,
            BLOCK_SIZE=self.block_size, TILE=self.tile, NUM_SEGMENTS=segments,
            FP32_DOT=self.interpreted or q.dtype == torch.float32,
            SLIDING=window > 0, SOFTCAP=softcap > 0,
        )  # fmt: skip
        if segments > 1:
            kernels._reduce_segments_kernel[(num_tokens, num_heads)](
                out, segm_out, segm_max, segm_sum, num_heads, out.stride(0), out.stride(1),
                HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self.head_dim_pad, NUM_SEGMENTS=segments,
            )  # fmt: skip
        return out


def _check_window_softcap(window: int, softcap: float) -> None:
    if window < 0:
        raise ValueError(f"window must be >= 0 keys (0: no window), got {window}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no cap), got {softcap}")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_rows(k: torch.Tensor, v: torch.Tensor) -> None:
    """The write kernel reads each token's heads as one contiguous row."""
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} and strides {t.stride()} does not hold a "
                "token's heads contiguously; pass a view whose last two dims are dense"
            )
