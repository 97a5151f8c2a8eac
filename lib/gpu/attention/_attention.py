"""Paged attention over a flattened mixed batch: prefill chunks and decodes together.

The KV cache of a layer is two tensors [num_blocks, block_size, kv_heads, head_dim]. A
sequence's tokens live in the blocks its block table lists; `slot_mapping` says where each
new token's K/V goes (block * block_size + offset). One interface, `paged_attention`, with a
torch reference path (SDPA over gathered blocks) that is exact on CPU and CUDA. Decodes are
batched into one SDPA call per layer (padded to the longest context, masked); prefill chunks
run one SDPA call each, skipping the gather when the chunk is the whole context.

The `triton` backend (`_attention_triton`) has the same shape: a backend object builds a
step's metadata from numpy arrays once, and each layer calls `metadata.attend(...)`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


class StepAttention(Protocol):
    """A step's attention metadata, built once, called by every layer."""

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
        """Write this step's k, v [T, Hkv, D] to the cache, then attend q [T, H, D].

        `window` > 0: a query at position p sees keys p - window < j <= p (a sliding layer);
        `softcap` > 0: scores are softcap * tanh(score / softcap) (Gemma 2)."""
        ...


class QkvAttention(abc.ABC):
    """A step's attention that takes the qkv projection whole: rotary, the KV write and the
    attention in one call per layer (`_cpu_decode.CAttention`, in C). A base class, not
    a Protocol: the layer tells it from a `StepAttention` with one isinstance check."""

    @abc.abstractmethod
    def attend_qkv(
        self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D] -> the attention output [T, H D]."""


class AttentionBackend(Protocol):
    """Builds each step's `StepAttention` from the scheduled sequences (numpy)."""

    name: str

    def describe(self) -> str: ...

    def metadata(
        self,
        counts: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        slots: np.ndarray,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> StepAttention: ...


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's chunk of query tokens in the flattened batch."""

    token_start: int  # index of its first token in the flattened batch
    num_tokens: int
    context_len: int  # tokens of context after this step (computed + this chunk)
    block_ids: torch.Tensor | None  # its blocks, needed only when context > this chunk


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step by the model runner; shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_token_idx: torch.Tensor | None  # [D] positions of decode tokens in the batch
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool: key valid
    prefills: tuple[PrefillSpan, ...]
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # reused gather buffers (K, V)
    decode_lens: torch.Tensor | None = None  # [D] context lengths of the decodes
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window

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
        return paged_attention(q, k, v, k_cache, v_cache, self, scale, window, softcap)

    def decode_mask_for(self, window: int) -> torch.Tensor | None:
        """The decodes' key mask, narrowed to the last `window` keys of each (made once a
        step for each window the layers use)."""
        if not window or self.decode_mask is None or self.decode_lens is None:
            return self.decode_mask
        mask = self._window_masks.get(window)
        if mask is None:
            key_pos = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            recent = key_pos[None, :] >= (self.decode_lens - window)[:, None]
            mask = self.decode_mask & recent.view(self.decode_mask.shape)
            self._window_masks[window] = mask
        return mask


class TorchAttention:
    """The reference backend's metadata builder; owns the decode gather buffers."""

    name = "torch"

    def __init__(self, block_size: int, block_numel: int, dtype: torch.dtype, device: torch.device):
        """`block_numel`: elements of one K (or V) block of one layer on this rank."""
        self.block_size = block_size
        self.block_numel = block_numel
        self.dtype = dtype
        self.device = device
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def describe(self) -> str:
        return "attention torch (SDPA over gathered blocks)"

    def metadata(
        self,
        counts: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        slots: np.ndarray,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> AttentionMetadata:
        """Decodes batched into one gather + SDPA, prefill chunks one SDPA each.

        `block_tables` [S, width] holds each scheduled sequence's blocks (in scheduled order).
        """
        is_decode = (counts == 1) & (context_lens > 1)
        decodes = np.flatnonzero(is_decode)
        decode_idx = tables = mask = workspace = decode_lens = None
        token_starts = np.cumsum(counts) - counts
        if len(decodes):
            lens = context_lens[decodes]
            max_blocks = int(-(-lens.max() // self.block_size))
            tables = upload(block_tables[decodes, :max_blocks].astype(np.int64))
            key_pos = torch.arange(max_blocks * self.block_size, device=self.device)
            decode_lens = upload(lens)
            mask = (key_pos[None, :] < decode_lens[:, None]).view(len(decodes), 1, 1, -1)
            decode_idx = upload(token_starts[decodes])
            workspace = self._gather_workspace(len(decodes) * max_blocks)
        prefills = []
        for i in np.flatnonzero(~is_decode).tolist():
            count, context = int(counts[i]), int(context_lens[i])
            block_ids = None
            if context > count:
                n = -(-context // self.block_size)
                block_ids = upload(block_tables[i, :n].astype(np.int64))
            prefills.append(PrefillSpan(int(token_starts[i]), count, context, block_ids))
        return AttentionMetadata(
            upload(slots), decode_idx, tables, mask, tuple(prefills), workspace, decode_lens
        )

    def _gather_workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers for `num_blocks` gathered blocks, reused across layers and steps."""
        need = num_blocks * self.block_numel
        if self._workspace is None or self._workspace[0].numel() < need:
            size = max(need, 2 * (0 if self._workspace is None else len(self._workspace[0])))
            self._workspace = (
                torch.empty(size, dtype=self.dtype, device=self.device),
                torch.empty(size, dtype=self.dtype, device=self.device),
            )
        return self._workspace


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store this step's K/V [T, Hkv, D] at their slots."""
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, dim).index_copy_(0, slots, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's cached context; returns [T, H, D].

    k and v [T, Hkv, D] are this step's keys and values; they are written to the cache first.
    `window`, `softcap`: as `StepAttention.attend` says.
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode_token_idx is not None:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        idx = meta.decode_token_idx
        tables, mask = meta.decode_block_tables, meta.decode_mask_for(window)
        assert mask is not None
        out[idx] = _decode(q[idx], k_cache, v_cache, tables, mask, scale, meta.workspace, softcap)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        out[rows] = _prefill(
            q[rows], k[rows], v[rows], k_cache, v_cache, span, scale, window, softcap
        )
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Copy the blocks `block_ids` [..., nb] into [..., nb * block_size, Hkv, D].

    `index_select` into a reused buffer: on CPU, advanced indexing into a fresh tensor was
    ~19x slower (its element-wise kernel plus page faults of a new allocation every layer).
    """
    flat = block_ids.reshape(-1)
    rows = cache.view(cache.shape[0], -1)
    if out is not None:
        out = out[: flat.numel() * rows.shape[1]].view(flat.numel(), rows.shape[1])
        torch.index_select(rows, 0, flat, out=out)
    else:
        out = rows.index_select(0, flat)
    return out.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA of q [B, H, Lq, D] over k, v [B, Hkv, Lk, D] (`mask` True: attend); with a
    softcap, written out (SDPA has none): scores capped by tanh before the mask."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
    softcap: float,
) -> torch.Tensor:
    k_out, v_out = workspace if workspace is not None else (None, None)
    keys = _gather(k_cache, block_tables, k_out).transpose(1, 2)  # [D, Hkv, L, Dh]
    values = _gather(v_cache, block_tables, v_out).transpose(1, 2)
    out = attention(q.unsqueeze(2), keys, values, mask, scale, softcap)
    return out.squeeze(2)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    n = span.num_tokens
    mask: torch.Tensor | None
    if span.context_len == n:  # the whole context is this chunk: no gather
        keys, values, mask, causal = k, v, None, window == 0 or window >= n
    else:
        assert span.block_ids is not None
        keys = _gather(k_cache, span.block_ids, None)[: span.context_len]
        values = _gather(v_cache, span.block_ids, None)[: span.context_len]
        causal = False
    if not causal:
        start = span.context_len - n
        q_pos = torch.arange(start, span.context_len, device=q.device)[:, None]
        k_pos = torch.arange(span.context_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
    # [1, H, n, D]: with a batch dimension SDPA's CPU kernel ran ~2.5x faster than on 3-D input
    out = attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        mask,
        scale,
        softcap,
        causal=causal,
    )
    return out.squeeze(0).transpose(0, 1)
