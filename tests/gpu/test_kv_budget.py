"""The KV cache's budget on a CUDA device (`_kv_budget`, issue 48 item 7), with an H100's
numbers: reserved memory, not allocated, is what the profile took, and the decode graphs'
pool is kept free, sized from their largest batch's eager forward.

The worker's reading of the device runs here with `torch.cuda`'s counters replaced by the
numbers a device would give (no CUDA on this machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trillm.gpu import Worker, WorkerConfig
from trillm.gpu.worker._kv_budget import CAPTURE_WORKSPACE, DeviceMemory, kv_budget, margin_note

from .conftest import save_tiny

GIB, MIB = 1 << 30, 1 << 20
H100 = 80 * GIB


def test_reserved_memory_and_the_graph_margin_come_off_the_budget() -> None:
    memory = DeviceMemory(
        total=H100,
        free_at_start=H100 - 2 * GIB,  # another process held 2 GiB before us
        peak_reserved=20 * GIB,  # weights and the profile's activations, as reserved
        graph_activations=300 * MIB,
    )
    assert memory.graph_margin == 300 * MIB + CAPTURE_WORKSPACE
    assert kv_budget(memory, 0.9) == int(H100 * 0.9) - 2 * GIB - 20 * GIB - memory.graph_margin
    eager = DeviceMemory(H100, H100 - 2 * GIB, 20 * GIB, graph_activations=0)
    assert eager.graph_margin == 0  # --enforce-eager, TP > 1: no pool is captured
    assert kv_budget(eager, 0.9) - kv_budget(memory, 0.9) == 300 * MIB + CAPTURE_WORKSPACE


def test_the_capture_line_says_whether_the_pool_kept_within_its_margin() -> None:
    assert margin_note(200 * MIB, 364 * MIB) == (
        "; within the 364 MiB kept for them when the KV cache was sized"
    )
    assert "OVER the 364 MiB" in margin_note(400 * MIB, 364 * MIB)
    assert margin_note(200 * MIB, 0) == ""


class FakeCuda:
    """`torch.cuda`'s memory counters as an H100 would move them through the profile runs:
    the full budget's forward peaks at 1.5 GiB allocated over 8 GiB of weights (2 GiB
    reserved besides), the 512-decode graph batch at 120 MiB."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.reserved = 8 * GIB, 8 * GIB, 10 * GIB
        self.runs: list[tuple[int, int]] = []

    def profile_run(self, *, num_seqs: int = 0, seq_len: int = 0) -> None:
        self.runs.append((num_seqs, seq_len))
        bump = 120 * MIB if seq_len == 1 else int(1.5 * GIB)
        self.peak = max(self.peak, self.allocated + bump)
        self.reserved = max(self.reserved, self.allocated + bump + 2 * GIB)

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak = self.allocated


def test_the_worker_reads_reserved_memory_and_profiles_the_largest_graph_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Worker(WorkerConfig(str(save_tiny(tmp_path, "llama")), device="cpu"))
    worker.init_device()
    worker.load_model()
    fake = FakeCuda()
    monkeypatch.setattr(worker, "profile_run", fake.profile_run)
    monkeypatch.setattr(worker.runner, "graph_sizes", lambda: (1, 2, 4, 8, 256))
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: fake.allocated)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: fake.peak)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: fake.reserved)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (H100 - 3 * GIB, H100))
    worker.free_memory_at_start = H100 - GIB
    memory = worker.profile_memory()
    assert fake.runs == [(0, 0), (256, 1)]  # the full budget, then the largest graph batch
    assert memory == DeviceMemory(
        total=H100,
        free_at_start=H100 - GIB,
        peak_reserved=8 * GIB + int(1.5 * GIB) + 2 * GIB,  # reserved, not the 9.5 allocated
        graph_activations=120 * MIB,
    )
    monkeypatch.setattr(worker.runner, "graph_sizes", lambda: ())  # eager: no second run
    fake.runs.clear()
    assert worker.profile_memory().graph_activations == 0 and fake.runs == [(0, 0)]


def test_the_graph_batch_profile_runs_for_real_and_leaves_no_request(tmp_path: Path) -> None:
    worker = Worker(WorkerConfig(str(save_tiny(tmp_path, "llama")), device="cpu"))
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(64)
    worker.profile_run(num_seqs=8, seq_len=1)  # eight one-token prompts: a decode's shapes
    assert not worker.runner.sampling  # no request left behind
