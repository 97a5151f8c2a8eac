"""`trillm serve --max-engine-restarts 2`: SIGKILL of the engine, and the server serves again.

/health is 503 while the engine restarts and 200 after; `trillm:engine_restarts_total`
counts it; a request after it succeeds; no shared-memory segment of the dead engine is left.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import trio

from trillm.default_model import default_model_dir

from ..procs import children
from .figures import record
from .http_harness import parse_metrics, tiny_model_dir
from .proc_harness import (
    Served,
    completion,
    completion_texts,
    health_or_0,
    served,
    stream_through_strike,
    wait_for,
    wait_restarted,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


async def test_a_killed_engine_is_restarted_and_the_server_serves_again(model: Path) -> None:
    with served(model, "--max-engine-restarts", "2") as server:
        first = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert first.status_code == 200
        engine = server.engine_pid()
        os.kill(engine, signal.SIGKILL)
        seen: list[int] = []
        # The restart takes a model load (over a second), the polls milliseconds: a 503 shows.
        new = await wait_restarted(server, engine, 90, seen)
        assert 503 in seen
        assert new != engine
        reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert reply.status_code == 200
        metrics = await trio.to_thread.run_sync(lambda: parse_metrics(metrics_text(server)))
        assert metrics["trillm:engine_restarts_total"] == 1
        output = server.output()
        assert "starting it again (restart 1, at most 2 within 300 s)" in output
        assert "engine restarted in" in output
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"trillm-{engine}-")]


async def test_a_request_waits_for_the_restart_up_to_its_bound_then_gets_503_retry_after(
    model: Path,
) -> None:
    """While the engine restarts, a request waits for it; past `--engine-restart-wait` it gets
    503 with Retry-After (the restart goes on: here its successor is held stopped). Once the
    successor runs again, the server serves."""
    args = ("--max-engine-restarts", "2", "--engine-restart-wait", "0.5")
    with served(model, *args, "--engine-watchdog-timeout", "30") as server:
        engine = server.engine_pid()
        os.kill(engine, signal.SIGKILL)

        def successor() -> bool:
            # Stopped after its exec (its command line is no longer the server's): stopped
            # between fork and exec, it would hold the server's Popen, not just the restart.
            new = [pid for pid in children(server.pid) if pid != engine]
            if new and cmdline(new[0]) not in (b"", cmdline(server.pid)):
                os.kill(new[0], signal.SIGSTOP)  # long before its model is loaded
                successors.append(new[0])
            return bool(successors)

        successors: list[int] = []
        await trio.to_thread.run_sync(lambda: wait_for(successor, 30, "a new engine"))
        try:
            started = time.monotonic()
            reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
            waited = time.monotonic() - started
            assert reply.status_code == 503, reply.text
            assert reply.headers["retry-after"] == "5"
            message = reply.json()["error"]["message"]
            assert message.startswith("the engine is restarting (after: engine process killed by")
            assert "not back within 0.5 s (--engine-restart-wait)" in message
            assert 0.5 <= waited < 5
        finally:
            os.kill(successors[0], signal.SIGCONT)
        await trio.to_thread.run_sync(
            lambda: wait_for(lambda: health_or_0(server) == 200, 90, "the restart")
        )
        reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert reply.status_code == 200


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def metrics_text(server: Served) -> str:
    return httpx.get(f"{server.base_url}/metrics", timeout=10).text


@pytest.mark.slow
async def test_32_open_streams_resume_after_a_sigkill_with_the_uninterrupted_text() -> None:
    """Every stream completes with no error and the uninterrupted run's greedy text. On the
    default model: the tiny one finishes 32 streams before a client has read their first
    tokens, so a kill would find nothing open."""
    prompts = [[1000 + 7 * i + j for j in range(12)] for i in range(32)]
    body = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
    args = ("--max-engine-restarts", "2", "--max-model-len", "256", "--max-num-seqs", "32")
    with served(default_model_dir(), *args) as server:
        url = f"{server.base_url}/v1/completions"
        async with httpx.AsyncClient(timeout=120) as client:
            expected = await completion_texts(client, url, prompts, body)  # never interrupted
            engine = server.engine_pid()
            got = await stream_through_strike(
                client, url, prompts, body, lambda: os.kill(engine, signal.SIGKILL)
            )
        assert not got.errors
        assert got.texts == expected
        assert got.first_after_strike is not None, (
            f"no token after the kill: every stream had ended before it\n{server.output()}"
        )
        record(15, "SIGKILL of the engine, 32 open streams: kill to the first resumed token",
               got.first_after_strike, "s")  # fmt: skip
        assert "32 open requests resume on it" in server.output()
