"""perf/gpu_check.sh: its dry run passes on CPU and reports every part; without a GPU, a real
run fails part by part, goes on, and exits non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "gpu_check.sh"
PARTS = ["setup", "pytest", "bench", "serve"]
FILES = {"gpu_check.json", "summary.txt", *(f"{part}.log" for part in PARTS)}

pytestmark = pytest.mark.timeout(300)


def gpu_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=290
    )
    return proc, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_the_dry_run_passes_and_reports_every_part(tmp_path: Path) -> None:
    proc, report = gpu_check(tmp_path / "out", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in (tmp_path / "out").iterdir()} == FILES  # the device returns 8
    assert (report["dry_run"], report["finished"], report["ok"]) == (True, True, True)
    assert list(report["parts"]) == PARTS
    assert all(p["ok"] and p["rc"] == 0 for p in report["parts"].values())
    assert report["env"]["missing"] == {}
    pytest_counts = report["pytest"]
    assert pytest_counts["skipped"] >= 8 and pytest_counts["passed"] == 0  # gpu tests skip

    bench = report["bench"]
    assert bench["dry_run"] and bench["problems"] == []
    assert [row["batch"] for row in bench["decode"]] == [1, 8, 32, 64]
    for row in bench["decode"]:
        assert row["eager_ms"] > 0 and row["graphs_ms"] > 0 and row["roofline_ms"] > 0
        assert row["weight_bytes"] > 0 and row["kv_bytes"] > 0
    assert [p["tokens"] for p in bench["prefill"]] == [32, 128]
    assert all(p["tflops"] > 0 for p in bench["prefill"])
    assert bench["copy_bandwidth_gbps"] > 0
    assert set(bench["capture"]) == {"eager", "graphs"}

    serve = report["serve"]
    assert serve["problems"] == []
    assert serve["model"]["vocab_size"] == 49152 and "SmolLM2" in serve["model"]["description"]
    assert [run["concurrency"] for run in serve["runs"]] == [1, 64]
    for run in serve["runs"]:
        assert run["completed"] == run["num_prompts"] and run["failed"] == 0
        assert run["median_ttft_ms"] > 0 and run["median_tpot_ms"] > 0
        assert run["output_throughput"] > 0
        assert run["gpu_busy_fraction"] is None  # no nvidia-smi on CPU

    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.startswith("gpu_check --dry-run on cpu")
    assert ": PASS in " in summary.splitlines()[0]
    assert "graphs ms" in summary and "TTFT med ms" in summary


@pytest.mark.slow
def test_without_a_gpu_each_part_fails_on_its_own_and_the_check_exits_non_zero(
    tmp_path: Path,
) -> None:
    """A real run here: no CUDA, so every part fails (quickly), each recorded, none skipped."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: a real run would pass (see the dry-run test)")
    proc, report = gpu_check(tmp_path / "out")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (report["dry_run"], report["finished"], report["ok"]) == (False, True, False)
    assert list(report["parts"]) == PARTS
    assert not any(p["ok"] for p in report["parts"].values())
    assert not any(p["timed_out"] for p in report["parts"].values())
    assert "no CUDA" in (tmp_path / "out" / "setup.log").read_text()
    assert "no CUDA" in (tmp_path / "out" / "bench.log").read_text()
    assert "no CUDA" in " ".join(report["serve"]["problems"])
    assert ": FAIL in " in (tmp_path / "out" / "summary.txt").read_text()
