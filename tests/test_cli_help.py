"""`trillm --help` and `trillm serve --help` stay word for word what they were (tests/data):
the flags are built from the configs' declarations, and that must not change a flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    ("args", "expected"), [(("serve", "--help"), "serve_help.txt"), (("--help",), "help.txt")]
)
def test_the_help_is_unchanged(args: tuple[str, ...], expected: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "trillm.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == (DATA / expected).read_text()
