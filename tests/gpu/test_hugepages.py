"""Tiled weights and the CPU KV cache on transparent huge pages (`_hugepages`)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from trillm.gpu.cpu import _hugepages
from trillm.gpu.cpu._hugepages import huge_zeros, on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_a_copy_is_equal_zeroed_where_untouched_and_outlives_its_mapping_name() -> None:
    source = torch.arange(3 << 18, dtype=torch.float32).view(3, -1)  # 3 MiB
    copy = on_huge_pages(source)
    gc.collect()
    assert copy.data_ptr() != source.data_ptr() and copy.data_ptr() % _hugepages.HUGE_PAGE == 0
    assert torch.equal(copy, source)
    zeros = huge_zeros((5, 1 << 18), torch.bfloat16)
    assert zeros.dtype == torch.bfloat16 and zeros.shape == (5, 1 << 18)
    assert not zeros.any()


def test_small_tensors_and_the_switch_keep_plain_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither a tensor under `MIN_BYTES` nor anything with `ENABLED` off maps memory."""

    def no_mapping(*args: object, **kwargs: object) -> None:
        raise AssertionError("mapped")

    monkeypatch.setattr(_hugepages.mmap, "mmap", no_mapping)
    small = torch.ones(16)
    assert on_huge_pages(small) is small
    assert not huge_zeros((16,), torch.float32).any()
    monkeypatch.setattr(_hugepages, "ENABLED", False)
    plain = huge_zeros((1 << 20,), torch.float32)
    assert plain.shape == (1 << 20,) and not plain.any()
    big = torch.ones(1 << 20)
    assert torch.equal(on_huge_pages(big), big)


@pytest.mark.skipif(
    sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages off here",
)
def test_the_kernel_lends_huge_pages_to_them() -> None:
    before = _anon_huge_kib()
    tensor = huge_zeros((8 << 20,), torch.uint8)
    tensor.fill_(1)  # the faults: 2 MiB at a time
    assert _anon_huge_kib() - before >= 4096, "no huge page behind an advised mapping"
