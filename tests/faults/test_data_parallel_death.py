"""`--data-parallel-size 2`: SIGKILL of one engine fails only that engine's streams.

The streams it held end with an error naming it ("engine 1 process killed by signal 9"), the
other engine's streams run to their end, /health stays 200 and new requests succeed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio

from ..procs import children
from .http_harness import tiny_model_dir
from .proc_harness import completion, health, served, strike_during_streams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.mark.slow
async def test_one_engines_sigkill_fails_only_its_streams(model: Path) -> None:
    with served(model, "--data-parallel-size", "2") as server:
        engines = sorted(children(server.pid))  # spawned in order: engine 0, then engine 1
        assert len(engines) == 2
        server.seen.update(engines)
        streams, _, _ = await strike_during_streams(
            server, lambda: os.kill(engines[1], signal.SIGKILL), n=8, limit=120
        )
        failed = [s for s in streams if s.error is not None]
        whole = [s for s in streams if s.error is None]
        assert failed and whole  # the load put streams on both engines
        assert {s.error for s in failed} == {
            "the engine died: engine 1 process killed by signal 9 (SIGKILL)"
        }
        assert all(s.num_tokens > 0 and s.ended_at is not None for s in whole)  # to [DONE]
        assert await trio.to_thread.run_sync(health, server) == 200
        for _ in range(3):
            reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
            assert reply.status_code == 200
        assert "engines [0] keep serving" in server.output()
