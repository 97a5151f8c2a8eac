"""The STEP record: one engine step's outputs for every request, columnar (DESIGN.md §4).

::

    header  step u64 | num_rows u32 | num_tokens u32 | sections u16 | topk u16 |
            num_finished u32 | monotonic_ns u64                          (32 bytes)
    rnum           u64[num_rows]
    tok_offsets    u32[num_rows + 1]       row i's tokens: tokens[off[i]:off[i+1]]
    tokens         i32[num_tokens]
    finish         u8[num_rows]            0 running, 1 stop, 2 length, 3 abort, 4 error
    [SEC_LOGPROBS] f32[num_tokens]         the sampled tokens' logprobs
    [SEC_TOPK]     i32[num_tokens * topk], f32[num_tokens * topk]
    [SEC_CACHED]   u32[num_rows]           prefix-cache hits of the row's request
    [SEC_POOLED]   num_pooled u32 | dim u32
                   pooled_rnum u64[num_pooled]   the request of each pooled row
                   pooled f32[num_pooled, dim]   one contiguous block for the whole step

Each array starts 8-byte aligned, so the reader takes numpy views straight over the ring.
`num_finished` lets a reader skip the finish column when no row finished (most steps).

The pooled section carries the results of pooling requests (embeddings) that finished this
step (DESIGN.md §4): one row per request, or one per prompt token for ALL pooling (its rows
are consecutive and share the rnum). Its two counts lead the section rather than the header,
so that records without it keep their layout. The request's own row (no tokens, finish STOP)
ends it as for any other.
"""

from __future__ import annotations

import enum
import struct
import time
from typing import Final

import numpy as np

from ...transport_shm import RingWriter
from ._messages import STEP

STEP_HEADER: Final = struct.Struct("<QIIHHIQ")
SEC_LOGPROBS: Final = 1
SEC_TOPK: Final = 2
SEC_CACHED: Final = 4
SEC_POOLED: Final = 8
_POOLED_HEADER: Final = struct.Struct("<II")


class FinishReason(enum.IntEnum):
    """Why a request ended; the values are the STEP record's wire finish codes (DESIGN.md §4)."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


def _align(n: int) -> int:
    return (n + 7) & ~7


def _layout(rows: int, tokens: int, sections: int, k: int) -> tuple[list[int], int]:
    """Offsets of rnum, offsets, tokens, finish, logprobs, topk ids, topk logprobs, cached,
    and of the pooled section (its size comes from its own counts: `_pooled_layout`)."""
    sizes = [
        8 * rows,
        4 * (rows + 1),
        4 * tokens,
        rows,
        4 * tokens if sections & SEC_LOGPROBS else 0,
        4 * tokens * k if sections & SEC_TOPK else 0,
        4 * tokens * k if sections & SEC_TOPK else 0,
        4 * rows if sections & SEC_CACHED else 0,
        0,
    ]
    offsets, at = [], STEP_HEADER.size
    for size in sizes:
        offsets.append(at)
        at = _align(at + size)
    return offsets, at


def _pooled_layout(at: int, num_pooled: int, dim: int) -> tuple[int, int, int]:
    """Offsets of the pooled rnums and block of a section starting at `at`, and its end."""
    rnums = _align(at + _POOLED_HEADER.size)
    block = _align(rnums + 8 * num_pooled)
    return rnums, block, _align(block + 4 * num_pooled * dim)


def _put(view: memoryview, offset: int, array: np.ndarray, dtype: str) -> None:
    data = np.ascontiguousarray(array, dtype)
    view[offset : offset + data.nbytes] = data.reshape(-1).view(np.uint8).data


def write_step(
    writer: RingWriter,
    step: int,
    rnums: np.ndarray,
    tok_offsets: np.ndarray,
    tokens: np.ndarray,
    finish: np.ndarray,
    *,
    logprobs: np.ndarray | None = None,
    topk_ids: np.ndarray | None = None,
    topk_logprobs: np.ndarray | None = None,
    num_cached_tokens: np.ndarray | None = None,
    pooled_rnums: np.ndarray | None = None,
    pooled: np.ndarray | None = None,
    timeout: float | None = None,
) -> None:
    """Reserve, fill in place and commit one STEP record (`pooled`: f32[n, dim] with its
    `pooled_rnums` u64[n], or None)."""
    rows, num_tokens = len(rnums), len(tokens)
    k = 0 if topk_ids is None else int(topk_ids.shape[1])
    sections = (
        (SEC_LOGPROBS if logprobs is not None else 0)
        | (SEC_TOPK if k else 0)
        | (SEC_CACHED if num_cached_tokens is not None else 0)
        | (SEC_POOLED if pooled is not None else 0)
    )
    offsets, size = _layout(rows, num_tokens, sections, k)
    num_pooled, dim = (0, 0) if pooled is None else (int(pooled.shape[0]), int(pooled.shape[1]))
    if pooled is not None:
        _, _, size = _pooled_layout(offsets[8], num_pooled, dim)
    view = writer.reserve(size, timeout)
    num_finished = int(np.count_nonzero(finish))
    STEP_HEADER.pack_into(
        view, 0, step, rows, num_tokens, sections, k, num_finished, time.monotonic_ns()
    )
    _put(view, offsets[0], rnums, "<u8")
    _put(view, offsets[1], tok_offsets, "<u4")
    _put(view, offsets[2], tokens, "<i4")
    _put(view, offsets[3], finish, "u1")
    if logprobs is not None:
        _put(view, offsets[4], logprobs, "<f4")
    if k and topk_ids is not None and topk_logprobs is not None:
        _put(view, offsets[5], topk_ids, "<i4")
        _put(view, offsets[6], topk_logprobs, "<f4")
    if num_cached_tokens is not None:
        _put(view, offsets[7], num_cached_tokens, "<u4")
    if pooled is not None and pooled_rnums is not None:
        at_rnums, at_block, _ = _pooled_layout(offsets[8], num_pooled, dim)
        _POOLED_HEADER.pack_into(view, offsets[8], num_pooled, dim)
        _put(view, at_rnums, pooled_rnums, "<u8")
        _put(view, at_block, pooled, "<f4")
    writer.commit(STEP)


class StepView:
    """Numpy views over one STEP record's columns; valid until the ring record is released."""

    __slots__ = (
        "finish",
        "logprobs",
        "monotonic_ns",
        "num_cached_tokens",
        "num_finished",
        "num_rows",
        "num_tokens",
        "pooled",
        "pooled_rnums",
        "rnums",
        "step",
        "tok_offsets",
        "tokens",
        "topk",
        "topk_ids",
        "topk_logprobs",
    )

    def __init__(self, payload: memoryview) -> None:
        (
            self.step,
            rows,
            tokens,
            sections,
            k,
            self.num_finished,
            self.monotonic_ns,
        ) = STEP_HEADER.unpack_from(payload)
        self.num_rows, self.num_tokens, self.topk = rows, tokens, k
        o, _ = _layout(rows, tokens, sections, k)
        self.rnums = np.frombuffer(payload, "<u8", rows, o[0])
        self.tok_offsets = np.frombuffer(payload, "<u4", rows + 1, o[1])
        self.tokens = np.frombuffer(payload, "<i4", tokens, o[2])
        self.finish = np.frombuffer(payload, "u1", rows, o[3])
        self.logprobs = (
            np.frombuffer(payload, "<f4", tokens, o[4]) if sections & SEC_LOGPROBS else None
        )
        self.topk_ids: np.ndarray | None = None
        self.topk_logprobs: np.ndarray | None = None
        if sections & SEC_TOPK:
            self.topk_ids = np.frombuffer(payload, "<i4", tokens * k, o[5]).reshape(tokens, k)
            self.topk_logprobs = np.frombuffer(payload, "<f4", tokens * k, o[6]).reshape(tokens, k)
        self.num_cached_tokens = (
            np.frombuffer(payload, "<u4", rows, o[7]) if sections & SEC_CACHED else None
        )
        self.pooled_rnums: np.ndarray | None = None
        self.pooled: np.ndarray | None = None  # f32 [num_pooled, dim]
        if sections & SEC_POOLED:
            num_pooled, dim = _POOLED_HEADER.unpack_from(payload, o[8])
            at_rnums, at_block, _ = _pooled_layout(o[8], num_pooled, dim)
            self.pooled_rnums = np.frombuffer(payload, "<u8", num_pooled, at_rnums)
            self.pooled = np.frombuffer(payload, "<f4", num_pooled * dim, at_block).reshape(
                num_pooled, dim
            )
