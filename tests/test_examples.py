"""The examples run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stream_chat_example_answers() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples/stream_chat.py"), "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
