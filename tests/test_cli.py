"""The `trillm` command line answers its help and version, and reaches the benchmark."""

from __future__ import annotations

import subprocess
import sys

from trillm import __version__


def trillm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trillm.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_version_and_help() -> None:
    assert trillm("--version").stdout.strip() == f"trillm {__version__}"
    help_text = trillm("serve", "--help").stdout
    for flag in ("--tensor-parallel-size", "--max-model-len", "--api-key", "--shutdown-timeout"):
        assert flag in help_text


def test_bench_serve_is_reachable_from_the_cli() -> None:
    run = trillm("bench", "serve", "--help")
    assert run.returncode == 0 and "--request-rate" in run.stdout and "--goodput" in run.stdout
