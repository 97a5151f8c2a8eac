"""Case 4: SIGSTOP of the engine. Its pidfd says it lives; its heartbeat says it stopped.

The watchdog declares it dead after `--engine-watchdog-timeout` and kills it; then as case
1. And the other side of the same coin: a forward pass longer than the timeout is no death.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import trio

from ..procs import is_dead
from .figures import record
from .http_harness import tiny_model_dir
from .proc_harness import completion, health, served, strike_during_streams

TIMEOUT = 2.0  # --engine-watchdog-timeout here


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.mark.slow
async def test_a_stopped_engine_is_declared_dead_after_the_watchdog_timeout(model: Path) -> None:
    args = ("--engine-watchdog-timeout", str(TIMEOUT), "--engine-death-grace", "1")
    with served(model, *args) as server:
        engine = server.engine_pid()
        streams, ended, _stopped = await strike_during_streams(
            server, lambda: os.kill(engine, signal.SIGSTOP), limit=90
        )
        assert len(ended) == 64
        record(4, f"streams ended after SIGSTOP (watchdog {TIMEOUT:g} s), first", min(ended), "s")
        record(4, f"streams ended after SIGSTOP (watchdog {TIMEOUT:g} s), last", max(ended), "s")
        # Silence is measured from the last beat the watchdog saw move, which can be one beat
        # (0.1 s) before the SIGSTOP; it checks every TIMEOUT / 4. Never before the timeout;
        # after it, soon (the streams would otherwise wait for the 90 s limit).
        assert min(ended) >= TIMEOUT - 0.2 and max(ended) < TIMEOUT + 5
        for stream in streams:
            assert stream.error is not None
            assert stream.error.startswith(
                "the engine died: EngineNotRespondingError in engine: no heartbeat from the "
                f"engine process (pid {engine}, state T (stopped)) for "
            )
            assert stream.error.endswith(
                "more than the watchdog timeout of 2 s (--engine-watchdog-timeout); it was "
                "killed with SIGKILL"
            )
        assert await trio.to_thread.run_sync(health, server) == 503
        assert (await trio.to_thread.run_sync(completion, server)).status_code == 503
        assert is_dead(engine)  # killed, not left stopped
        assert await trio.to_thread.run_sync(server.wait_exit, 30) == 1
        assert "trillm serve: the engine died: EngineNotRespondingError" in server.output()


@pytest.mark.slow
async def test_a_forward_pass_longer_than_the_watchdog_timeout_is_no_death(model: Path) -> None:
    step = 3.0  # the null executor's step time: three times the timeout, in one forward
    args = ("--executor", "null", "--null-step-time", str(step), "--engine-watchdog-timeout", "1")
    with served(model, *args) as server:
        started = time.monotonic()
        response = await trio.to_thread.run_sync(
            lambda: httpx.post(
                f"{server.base_url}/v1/completions",
                json={"prompt": "x", "max_tokens": 1, "ignore_eos": True},
                timeout=60,
            )
        )
        took = time.monotonic() - started
        record(4, "a request of one 3 s step under a 1 s watchdog took", took, "s")
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 1
        assert took >= step
        assert await trio.to_thread.run_sync(health, server) == 200
        assert "EngineNotRespondingError" not in server.output()
