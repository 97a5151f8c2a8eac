"""`trillm serve --max-engine-restarts 2`: SIGKILL of the engine, and the server serves again.

/health is 503 while the engine restarts and 200 after; `trillm:engine_restarts_total`
counts it; a request after it succeeds; no shared-memory segment of the dead engine is left.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from ..procs import children
from .http_harness import parse_metrics, tiny_model_dir
from .proc_harness import Served, completion, served, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def health(base_url: str) -> int:
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


async def test_a_killed_engine_is_restarted_and_the_server_serves_again(model: Path) -> None:
    with served(model, "--max-engine-restarts", "2") as server:
        first = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert first.status_code == 200
        engine = server.engine_pid()
        os.kill(engine, signal.SIGKILL)
        seen: list[int] = []

        def serving_again() -> bool:
            seen.append(health(server.base_url))
            return seen[-1] == 200 and any(pid != engine for pid in children(server.pid))

        # The restart takes a model load (over a second), the polls milliseconds: a 503 shows.
        await trio.to_thread.run_sync(lambda: wait_for(serving_again, 90, "a restarted engine"))
        assert 503 in seen
        new = server.engine_pid()
        assert new != engine
        reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert reply.status_code == 200
        metrics = await trio.to_thread.run_sync(lambda: parse_metrics(metrics_text(server)))
        assert metrics["trillm:engine_restarts_total"] == 1
        output = server.output()
        assert "starting it again (restart 1, at most 2 within 300 s)" in output
        assert "engine restarted in" in output
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"trillm-{engine}-")]


def metrics_text(server: Served) -> str:
    return httpx.get(f"{server.base_url}/metrics", timeout=10).text
