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
    death = ("--engine-death-grace", "--keep-alive-on-engine-death", "--engine-watchdog-timeout")
    for flag in death:
        assert flag in help_text
    assert "--inject-fault" not in help_text  # a test hook, not an option


def test_engine_death_settings_out_of_range_are_refused_before_starting() -> None:
    run = trillm("serve", "no-such-model", "--engine-watchdog-timeout", "0.1")
    assert run.returncode == 1
    assert run.stderr == (
        "trillm serve: the engine watchdog timeout must be 0 (off) or at least 0.5 s "
        "(the heartbeat's jitter), got 0.1\n"
    )
    run = trillm("serve", "no-such-model", "--engine-death-grace", "-1")
    assert run.returncode == 1
    assert run.stderr == "trillm serve: --engine-death-grace must be >= 0 seconds, got -1.0\n"


def test_bench_serve_is_reachable_from_the_cli() -> None:
    run = trillm("bench", "serve", "--help")
    assert run.returncode == 0 and "--request-rate" in run.stdout and "--goodput" in run.stdout
