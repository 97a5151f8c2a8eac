"""Case 1: SIGKILL of the engine under 64 open streams.

Every stream ends within 500 ms with an error naming signal 9, /health and new requests get
503, and the server exits non-zero after `--engine-death-grace` (or keeps answering 503 with
`--keep-alive-on-engine-death`, which case 3 covers).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import trio

from .figures import AT_ONCE, record
from .http_harness import tiny_model_dir
from .proc_harness import completion, health, served, shm_names_of, strike_during_streams, wait_dead

GRACE = 2.0  # --engine-death-grace here: long enough to check the 503s, short for the test


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


async def test_sigkill_of_the_engine_ends_64_streams_naming_signal_9_then_exits(
    model: Path,
) -> None:
    with served(model, "--engine-death-grace", str(GRACE)) as server:
        engine = server.engine_pid()
        streams, ended, killed = await strike_during_streams(
            server, lambda: os.kill(engine, signal.SIGKILL), limit=90
        )
        assert len(ended) == 64
        record(
            1, "last of 64 open streams ended after the engine's SIGKILL", max(ended) * 1e3, "ms"
        )
        assert max(ended) < AT_ONCE
        assert all(s.num_tokens > 0 for s in streams)
        messages = {s.error for s in streams}
        assert messages == {"the engine died: engine process killed by signal 9 (SIGKILL)"}

        assert await trio.to_thread.run_sync(health, server) == 503
        refused = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert refused.status_code == 503
        assert "killed by signal 9 (SIGKILL)" in refused.json()["error"]["message"]
        streaming = await trio.to_thread.run_sync(lambda: completion(server, stream=True))
        assert streaming.status_code == 503  # refused before a 200 could start a stream

        code = await trio.to_thread.run_sync(server.wait_exit, GRACE + 30)
        exited = time.monotonic() - killed
        record(1, f"server exited after the engine's death (grace {GRACE:g} s)", exited, "s")
        assert code == 1
        assert GRACE <= exited < GRACE + 10
        output = server.output()
        assert "exiting in 2 s (--engine-death-grace)" in output
        assert "trillm serve: the engine died: engine process killed by signal 9 (SIGKILL)" in (
            output
        )
        wait_dead(server.seen, 5)
        assert shm_names_of(server.seen) == []
