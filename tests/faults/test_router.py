"""Two `trillm serve` replicas behind vllm-router (`--policy cache_aware`), as docs/deploy.md
deploys them: a shared prompt prefix sticks to one replica, and when that replica's whole
process tree is SIGKILLed every following request is still served, by the other one.

Which replica served a request is read from each replica's own /metrics (finished requests),
never from the router. The replicas run the null executor with a step time: a request then
lasts at least max_tokens steps on any machine, so a stream held open on the sticky replica
is still open while the other requests are routed (checked, not assumed), and the router sees
that replica as the busier one. What the router does with that is the point: with cache_aware
a request that shares the long prefix still goes to the busier replica (the prefix wins), and a
request with a new prefix goes to the idle one (the load wins).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
import trio

from ..http.conftest import free_port
from .http_harness import parse_metrics, tiny_model_dir
from .proc_harness import Served, served, wait_dead

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROUTER = Path(sys.executable).with_name("vllm-router")
STEP = 0.1  # the null executor's step (s): the held stream lasts >= HELD_TOKENS * STEP
HELD_TOKENS = 120
# ~750 characters (~250 tokens): far past the router's match threshold (30 % of the text), and
# short enough for the tiny model's 512 positions with HELD_TOKENS on top.
PREFIX = (
    "You are a careful assistant. Answer only from the context below, and say so when the "
    "context does not hold the answer.\n"
    + "".join(
        f"Fact {i}: the {thing} is in the {room}.\n"
        for i, (thing, room) in enumerate(
            (thing, room)
            for thing in ("red box", "blue key", "old map", "small lamp")
            for room in ("kitchen", "attic", "garden", "cellar")
        )
    )
)
OTHER = "Summarise this build log in one line.\n" + "".join(
    f"step {step}: ok\n" for step in ("fetch", "configure", "compile", "link", "test", "package")
)
AFTER_DEATH = 8


async def scrape(client: httpx.AsyncClient, replica: Served) -> dict[str, float]:
    response = await client.get(f"{replica.base_url}/metrics", timeout=30)
    assert response.status_code == 200
    return parse_metrics(response.text)


async def served_count(client: httpx.AsyncClient, replica: Served) -> float:
    """The requests `replica` has finished (every finish reason), from its own /metrics."""
    return (await scrape(client, replica))["trillm:request_success_total"]


@contextmanager
def router(worker_urls: list[str]) -> Iterator[str]:
    """vllm-router over `worker_urls` (cache_aware), ready with every worker healthy; its base
    URL. Its process group is SIGKILLed on the way out; its log is printed on a failure."""
    if not ROUTER.exists():
        pytest.fail(f"{ROUTER} is missing: install the test extras (pip install -e '.[test]')")
    port = free_port()
    command = [
        str(ROUTER), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", "cache_aware",
        # A dead worker is dropped after 3 failed attempts (its circuit breaker opens: fewer
        # than the 5 attempts a request gets, so the request's next attempt goes elsewhere) or
        # at its first failed health check, 1 s apart (the defaults: 10 failures, 60 s).
        "--cb-failure-threshold", "3", "--health-failure-threshold", "1",
        "--health-check-interval-secs", "1", "--health-check-timeout-secs", "5",
        "--worker-startup-check-interval", "1",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "warning",
    ]  # fmt: skip
    fd, log_name = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_router_ready(process, base_url, len(worker_urls), 120)
        yield base_url
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if sys.exc_info()[0] is not None:
            print(f"--- vllm-router output ---\n{Path(log_name).read_text()}", file=sys.stderr)
        os.unlink(log_name)


def wait_router_ready(
    process: subprocess.Popen[bytes], base_url: str, workers: int, timeout: float
) -> None:
    """Until the router's /readiness counts `workers` healthy workers."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise AssertionError(f"vllm-router exited during start-up ({process.returncode})")
        with suppress(httpx.HTTPError, ValueError):
            response = httpx.get(f"{base_url}/readiness", timeout=2)
            if response.status_code == 200 and response.json()["healthy_workers"] == workers:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"vllm-router was not ready with {workers} workers in {timeout} s")
        time.sleep(0.1)


async def complete(client: httpx.AsyncClient, base_url: str, prompt: str) -> None:
    """One completion through the router; fails unless it is a 200 with a choice."""
    response = await client.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


async def served_by(
    client: httpx.AsyncClient, base_url: str, prompt: str, replicas: list[Served]
) -> Served:
    """The replica that served one completion sent to the router: the one whose count of
    finished requests grew (a non-streaming request is counted before its response is sent)."""
    before = [await served_count(client, r) for r in replicas]
    await complete(client, base_url, prompt)
    grew = [await served_count(client, r) - n for r, n in zip(replicas, before, strict=True)]
    assert sorted(grew) == [0] * (len(replicas) - 1) + [1], f"finished per replica: {grew}"
    return replicas[grew.index(1)]


async def hold_stream(
    client: httpx.AsyncClient, base_url: str, flowing: trio.Event, ended: list[str]
) -> None:
    """A long streaming completion with the shared prefix; `flowing` is set at its first
    token, and `ended` gets an entry if it ends by itself (it should outlive the checks)."""
    body = {
        "model": "tiny",
        "prompt": PREFIX + "Hold on.",
        "max_tokens": HELD_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), line
                flowing.set()
            elif line == "data: [DONE]":
                break
    ended.append("ended")


async def test_a_shared_prefix_sticks_to_one_replica_and_survives_its_death(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    args = ("--executor", "null", "--null-step-time", str(STEP))
    with served(model, *args) as a, served(model, *args) as b:
        replicas = [a, b]
        with router([a.base_url, b.base_url]) as base_url:
            async with httpx.AsyncClient() as client:
                # The first request with the prefix picks a replica: the sticky one.
                sticky = await served_by(client, base_url, PREFIX + "Question 0?", replicas)
                other = b if sticky is a else a

                ended: list[str] = []
                async with trio.open_nursery() as nursery:
                    flowing = trio.Event()
                    nursery.start_soon(hold_stream, client, base_url, flowing, ended)
                    with trio.fail_after(120):
                        await flowing.wait()
                    # The held stream went where its prefix is: the router counts that
                    # replica busier now. The prefix still wins; a new prefix does not.
                    running = [
                        (await scrape(client, r))["trillm:num_requests_running"] for r in replicas
                    ]
                    assert running == ([1, 0] if sticky is a else [0, 1]), running
                    for i in range(1, 5):
                        prompt = PREFIX + f"Question {i}?"
                        by = await served_by(client, base_url, prompt, replicas)
                        assert by is sticky, f"request {i} with the prefix went to {by.port}"
                    for i in range(3):
                        prompt = OTHER + f"step upload {i}: ok\n"
                        by = await served_by(client, base_url, prompt, replicas)
                        assert by is other, f"new-prefix request {i} went to {by.port}"
                    assert not ended, "the held stream ended before the checks: raise HELD_TOKENS"
                    nursery.cancel_scope.cancel()

                # SIGKILL the sticky replica's whole tree: the server and its engine.
                tree = sticky.tree()
                assert len(tree) >= 2, tree  # the frontend and its engine
                for pid in tree:
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                sticky.process.wait()
                wait_dead(tree, 30)

                survivor_before = await served_count(client, other)
                for i in range(AFTER_DEATH):
                    await complete(client, base_url, PREFIX + f"After {i}?")
                assert await served_count(client, other) - survivor_before == AFTER_DEATH
