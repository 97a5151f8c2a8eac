"""perf/gpu_check.sh: its dry run passes on CPU and reports every part; a part whose imports
fail is skipped and says why; without a GPU a real run fails fast at the setup; a SIGTERM still
leaves every result file. `make gpu-rehearsal` runs the dry run in the device image's packages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "gpu_check.sh"
PARTS = ["setup", "pytest", "bench", "serve"]
FILES = {"gpu_check.json", "summary.txt", *(f"{part}.log" for part in PARTS)}
GPU_TEST_FILES = ["tests/gpu/test_cuda.py", "tests/gpu/test_sampler_sync.py"]

pytestmark = pytest.mark.timeout(400)


def environment(out: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **extra}


def gpu_check(
    out: Path, *args: str, **extra: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=environment(out, **extra),
        capture_output=True,
        text=True,
        timeout=350,
    )
    return proc, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_the_dry_run_passes_and_reports_every_part(tmp_path: Path) -> None:
    proc, report = gpu_check(tmp_path / "out", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in (tmp_path / "out").iterdir()} == FILES  # the device returns 8
    assert (report["dry_run"], report["finished"], report["ok"]) == (True, True, True)
    assert list(report["parts"]) == PARTS
    assert all(p["state"] == "ok" and p["rc"] == 0 for p in report["parts"].values())
    assert report["env"]["missing"] == {} and report["env"]["blocked"] == {}
    pytest_log = (tmp_path / "out" / "pytest.log").read_text()
    assert f"the files with gpu-marked tests: {' '.join(GPU_TEST_FILES)}" in pytest_log
    pytest_counts = report["pytest"]
    assert pytest_counts["skipped"] >= 8 and pytest_counts["passed"] == 0  # gpu tests skip

    bench = report["bench"]
    assert bench["dry_run"] and bench["problems"] == []
    assert [row["batch"] for row in bench["decode"]] == [1, 8, 32, 64]
    assert [row["batch"] for row in bench["decode"] if row["eager_ms"]] == [1]  # eager at 1
    for row in bench["decode"]:
        assert row["graphs_ms"] > 0 and row["roofline_ms"] > 0
        assert sum(row["graphs_paths"].values()) == row["decode_steps"] + 1  # and the prefill
        assert row["weight_bytes"] > 0 and row["kv_bytes"] > 0
    assert [p["tokens"] for p in bench["prefill"]] == [32, 128]
    assert all(p["tflops"] > 0 for p in bench["prefill"])
    assert bench["copy_bandwidth_gbps"] > 0
    assert set(bench["capture"]) == {"eager", "graphs"}

    (launches,) = report["launches"]["launches"]  # --count-launches --dry-run: the tiny model
    step = launches["eager"][0]
    assert step["per_step"] == step["per_layer"] * launches["layers"] + step["outside_layers"]

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
    assert "graphs ms" in summary and "TTFT med ms" in summary and "per layer" in summary


@pytest.mark.slow
def test_a_part_whose_import_fails_is_skipped_and_says_why(tmp_path: Path) -> None:
    """hypercorn shadowed by a module that fails to import: the setup fails and names it, the
    serve part (which needs it) is skipped saying so, pytest and bench run, every file exists."""
    shadow = tmp_path / "shadow" / "hypercorn"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hypercorn is not on this image')\n")
    pythonpath = os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")]))
    proc, report = gpu_check(tmp_path / "out", "--dry-run", PYTHONPATH=pythonpath)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in (tmp_path / "out").iterdir()} == FILES
    assert (report["finished"], report["ok"]) == (True, False)
    states = {name: part["state"] for name, part in report["parts"].items()}
    assert states == {"setup": "failed", "pytest": "ok", "bench": "ok", "serve": "skipped"}
    assert report["parts"]["serve"]["note"].startswith("skipped: setup could not import hypercorn")
    assert "hypercorn is not on this image" in report["env"]["missing"]["hypercorn"]
    assert (
        "skipped: setup could not import hypercorn" in (tmp_path / "out" / "serve.log").read_text()
    )
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "cannot import hypercorn: ImportError: hypercorn is not on this image" in summary


@pytest.mark.slow
def test_without_a_gpu_the_setup_fails_and_the_parts_that_need_one_are_skipped(
    tmp_path: Path,
) -> None:
    """A real run here: no CUDA, so the setup fails and says so, and the rest is skipped at
    once (fail-fast: no device time spent on parts that cannot pass)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: a real run would pass (see the dry-run test)")
    proc, report = gpu_check(tmp_path / "out")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in (tmp_path / "out").iterdir()} == FILES
    assert (report["dry_run"], report["finished"], report["ok"]) == (False, True, False)
    assert list(report["parts"]) == PARTS
    assert report["parts"]["setup"]["state"] == "failed"
    assert "no CUDA" in (tmp_path / "out" / "setup.log").read_text()
    for name in PARTS[1:]:
        part = report["parts"][name]
        assert part["state"] == "skipped", part
        assert part["note"] == "skipped: no CUDA device visible to torch (setup)"
        assert "no CUDA device" in (tmp_path / "out" / f"{name}.log").read_text()
    assert ": FAIL in " in (tmp_path / "out" / "summary.txt").read_text()


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_a_sigterm_stops_the_running_part_and_still_writes_every_result_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--dry-run"],
        env=environment(out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # SIGTERM once the serve part's server is up
            if line.startswith("== serve: at most"):
                break
        log, deadline = out / "serve.log", time.monotonic() + 120
        while time.monotonic() < deadline and "$ bench_serve.py" not in read(log):
            time.sleep(0.1)  # a log file cannot be awaited
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 143, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert {p.name for p in out.iterdir()} == FILES
    report = json.loads((out / "gpu_check.json").read_text())
    assert (report["finished"], report["interrupted"], report["ok"]) == (True, True, False)
    states = {name: part["state"] for name, part in report["parts"].items()}
    assert states == {"setup": "ok", "pytest": "ok", "bench": "ok", "serve": "interrupted"}
    assert "interrupted by SIGTERM" in (out / "serve.log").read_text()
    # _gpu_serve.py wrote what it had before it stopped the server
    assert (
        "interrupted by SIGTERM (gpu_check.sh's bound for the part)" in report["serve"]["problems"]
    )
    assert ": INTERRUPTED in " in (out / "summary.txt").read_text().splitlines()[0]


def test_parts_skipped_for_time_are_notes_and_every_result_file_is_written(
    tmp_path: Path,
) -> None:
    """Issue 48, item 1: no time left is no failure of a part (its results, if any, stand).
    A budget of 1 s leaves every part under the 20 s a part needs: each is skipped for time,
    the check does not fail, and every result file exists."""
    proc, report = gpu_check(tmp_path / "out", "--dry-run", GPU_CHECK_BUDGET_S="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in (tmp_path / "out").iterdir()} == FILES
    assert (report["finished"], report["ok"]) == (True, True)
    assert report["skipped_for_time"] == PARTS
    for part in report["parts"].values():
        assert part["state"] == "no time" and part["rc"] == 0
        assert part["note"] == "skipped for time: under 20 s of the 1 s budget left"
    first = (tmp_path / "out" / "summary.txt").read_text().splitlines()[0]
    assert ": PASS (skipped for time, no failure: setup, pytest, bench, serve) in " in first
