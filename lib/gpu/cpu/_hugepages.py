"""What the CPU streams every decode step (tiled weights, the KV cache) on transparent huge
pages, where the kernel lends them.

Why: a decode step reads every tiled weight once (538 MB for SmolLM2 in float32), and at
batch 1 that read is the step; at batch 32 the KV cache adds as much again. With 4 KiB pages
the stream crosses a page, a TLB miss and a stop of the hardware prefetcher every 4 KiB; a
2 MiB page holds 512 of them. The C step of SmolLM2 float32 on them, batch 1: 24.6, 24.1,
25.0, 23.7 ms against 26.2, 27.5, 26.7, 26.8 on plain pages; batch 32: 70.0, 70.1, 71.8, 73.3
against 73.4, 73.7, 76.0, 69.4 (`perf/decode_profile.py --batch B [--no-huge-pages]`,
alternated fresh processes, quiet 2-core machine; perf/README.md). Linux lends huge pages to
private anonymous memory that asks (`madvise(MADV_HUGEPAGE)`) when
/sys/kernel/mm/transparent_hugepage/enabled is `madvise` (the common default) or `always`;
with `never`, or off Linux, the memory is plain pages and nothing else changes. Shared
anonymous memory (Python's `mmap` default) is shmem, which THP leaves alone: hence
MAP_PRIVATE.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
# Below this a tensor stays where torch puts it: a mapping of its own, aligned to 2 MiB,
# would cost more slack than the pages save.
MIN_BYTES = 1 << 20
ENABLED = True  # perf scripts turn it off to measure what it buys


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a 2 MiB-aligned private mapping advised to take huge pages
    (`torch.zeros` where it is small or that cannot be)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not ENABLED or nbytes < MIN_BYTES or advise is None or not flags:
        return torch.zeros(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=flags)  # zero pages until touched
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -start % HUGE_PAGE
    try:
        region.madvise(advise, offset, size)  # before the first touch: faults take 2 MiB
    except OSError:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)  # the tensor keeps `region` mapped


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (CPU, contiguous) copied onto huge pages (`huge_zeros`), or itself where it
    is small or off the CPU."""
    if tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < MIN_BYTES:
        return tensor
    out = huge_zeros(tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out
