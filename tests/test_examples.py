"""The examples run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
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


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_offline_batch_example_completes_100_prompts_in_order() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples/offline_batch.py")],
        capture_output=True,
        text=True,
        timeout=400,  # about 15 s on 2 idle cores; a loaded machine slows the engine tenfold
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "100 prompts, results in order: True" in result.stdout
    assert "'The capital of France is' -> ' Paris" in result.stdout
    assert "Processed prompts: 100%" in result.stderr  # the progress bar
