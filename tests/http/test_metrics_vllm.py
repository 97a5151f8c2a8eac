"""vLLM's metric names (`vllm:*`) beside ours: the same values, read from the same children.

The first tests use `Metrics` alone; the rest scrape a real `trillm serve` (null executor with
a step time, one running request at most), so a held stream is running and a second one
waits for as long as the test needs, on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from trillm.http.metrics._metrics import Metrics
from trillm.http.metrics._vllm import vllm_name

from .conftest import Server, start_server

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# What llm-d's endpoint picker and vLLM's production-stack router read, plus the counters and
# histograms dashboards built for vLLM plot.
ROUTER_NAMES = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def families(text: str) -> dict[str, str]:
    """Every family's name and type."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def samples(text: str) -> Samples:
    """Every sample by (name, sorted labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def aliases_match(found: Samples) -> None:
    """Each `vllm:` sample equals the `trillm:` sample of the same name and labels."""
    aliased = {key: v for key, v in found.items() if key[0].startswith("vllm:")}
    assert aliased
    for (name, labels), v in aliased.items():
        ours = found[("trillm:" + name.removeprefix("vllm:"), labels)]
        assert v == ours or (math.isnan(v) and math.isnan(ours)), name


ENGINE_SOURCED = {
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
}


def one(found: Samples, name: str, **labels: str) -> float:
    """A sample's value; what the engine reports carries `engine="0"` unless told."""
    if name.split(":", 1)[1] in ENGINE_SOURCED:
        labels.setdefault("engine", "0")
    return found[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]


def held(found: Samples) -> float:
    """Requests the engine still holds, running or waiting, by vLLM's names."""
    return one(found, "vllm:num_requests_running") + one(found, "vllm:num_requests_waiting")


# -- Metrics alone ---------------------------------------------------------------------------


def test_the_vllm_names_routers_read_are_exposed_with_vllm_s_types() -> None:
    metrics = Metrics("tiny")
    metrics.set_cache_config(block_size=16, num_gpu_blocks=2048)
    found = families(metrics.render().decode())
    assert {name: found.get(name) for name in ROUTER_NAMES} == ROUTER_NAMES
    assert found["vllm:cache_config_info"] == "gauge"
    # trillm's own figures stay under trillm's name only.
    for ours in ("kv_cache_free_blocks", "http_requests_in_flight", "frontend_request_states"):
        assert "trillm:" + ours in found and "vllm:" + ours not in found
    assert "vllm:kernel_info" not in found and "vllm:engine_steps" not in found


def test_every_alias_is_the_trillm_sample_of_the_same_labels() -> None:
    metrics = Metrics("tiny")
    aliases_match(samples(metrics.render().decode()))  # at zero
    metrics.observe_request(0.05, [0.02, 0.03], 1.2, 10, 3, "stop")
    metrics.count_aborted(2)
    metrics.set_engine_stats(
        {"num_running": 3, "num_waiting": 2, "kv_usage": 0.375, "prefix_cache_queries": 64}
    )
    found = samples(metrics.render().decode())
    aliases_match(found)
    assert one(found, "vllm:num_requests_running") == 3
    assert one(found, "vllm:num_requests_waiting") == 2
    assert one(found, "vllm:kv_cache_usage_perc") == 0.375
    assert one(found, "vllm:prompt_tokens_total") == 10
    assert one(found, "vllm:request_success_total", finished_reason="abort") == 2
    assert one(found, "vllm:time_to_first_token_seconds_bucket", le="0.06") == 1


def test_preemptions_are_the_engine_s_count_moved_forward() -> None:
    metrics = Metrics("tiny")
    metrics.set_engine_stats({"num_preemptions": 5})
    metrics.set_engine_stats({"num_preemptions": 7})
    metrics.set_engine_stats({"num_preemptions": 1})  # a new engine: counted from zero
    found = samples(metrics.render().decode())
    assert one(found, "trillm:num_preemptions_total") == 8
    assert one(found, "vllm:num_preemptions_total") == 8


def test_cache_config_info_has_one_series_with_the_last_shape() -> None:
    metrics = Metrics("tiny")
    assert "vllm:cache_config_info" not in {name for name, _ in samples(metrics.render().decode())}
    metrics.set_cache_config(block_size=16, num_gpu_blocks=100)
    metrics.set_cache_config(block_size=32, num_gpu_blocks=50)
    info = [
        dict(labels)
        for (name, labels), v in samples(metrics.render().decode()).items()
        if name == "vllm:cache_config_info" and v == 1
    ]
    assert info == [{"block_size": "32", "model_name": "tiny", "num_gpu_blocks": "50"}]


def test_only_trillm_names_have_a_vllm_name() -> None:
    assert vllm_name("trillm:num_requests_running") == "vllm:num_requests_running"
    with pytest.raises(ValueError, match=r"'sglang:x' is not a trillm metric name"):
        vllm_name("sglang:x")


# -- a real server ---------------------------------------------------------------------------

STEP = 0.05  # the null executor's step: a stream of n tokens lasts at least n * STEP


@pytest.fixture(scope="module")
def held_server(tiny_model: Path) -> Iterator[Server]:
    """A server that runs one request at a time, each step at least STEP long."""
    args = ("--executor", "null", "--null-step-time", str(STEP), "--max-num-seqs", "1")
    server = start_server(tiny_model, *args)
    try:
        yield server
    finally:
        server.stop()


async def scrape(client: httpx.AsyncClient, server: Server) -> Samples:
    response = await client.get(f"{server.base_url}/metrics", timeout=30)
    assert response.status_code == 200
    return samples(response.text)


async def test_a_completion_moves_the_vllm_counters_with_trillm_s(held_server: Server) -> None:
    async with httpx.AsyncClient() as client:
        before = await scrape(client, held_server)
        response = await client.post(
            f"{held_server.base_url}/v1/completions",
            json={"prompt": "count me", "max_tokens": 5, "ignore_eos": True},
            timeout=60,
        )
        assert response.status_code == 200
        usage = response.json()["usage"]
        after = await scrape(client, held_server)
    aliases_match(after)

    def grew(name: str, **labels: str) -> float:
        return one(after, name, **labels) - one(before, name, **labels)

    assert grew("vllm:prompt_tokens_total") == usage["prompt_tokens"] > 0
    assert grew("vllm:generation_tokens_total") == usage["completion_tokens"] == 5
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:prefix_cache_queries_total") >= usage["prompt_tokens"]
    assert 0 <= one(after, "vllm:kv_cache_usage_perc") <= 1


async def stream(client: httpx.AsyncClient, server: Server, first_token: trio.Event) -> None:
    """A streaming completion of 400 tokens (>= 20 s here): `first_token` is set when its
    first token arrives; read until cancelled."""
    body = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = f"{server.base_url}/v1/completions"
    async with client.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                first_token.set()


async def test_running_and_waiting_count_a_held_stream_and_the_one_behind_it(
    held_server: Server,
) -> None:
    async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
        running = trio.Event()
        nursery.start_soon(stream, client, held_server, running)
        with trio.fail_after(60):
            await running.wait()
        nursery.start_soon(stream, client, held_server, trio.Event())  # waits: one seq at most
        with trio.fail_after(60):
            while one(found := await scrape(client, held_server), "vllm:num_requests_waiting") < 1:
                await trio.sleep(0.02)
        aliases_match(found)
        assert one(found, "vllm:num_requests_running") == 1
        assert one(found, "vllm:num_requests_waiting") == 1
        assert 0 < one(found, "vllm:kv_cache_usage_perc") <= 1  # the running one holds blocks
        nursery.cancel_scope.cancel()  # both streams close: the engine aborts them
    async with httpx.AsyncClient() as client:
        with trio.fail_after(60):
            while held(found := await scrape(client, held_server)):
                await trio.sleep(0.02)
    aliases_match(found)
    assert 0 <= one(found, "vllm:kv_cache_usage_perc") <= 1


async def test_a_server_exposes_its_kv_cache_shape_as_vllm_s_cache_config_info(
    held_server: Server,
) -> None:
    async with httpx.AsyncClient() as client:
        found = await scrape(client, held_server)
    info = [dict(labels) for (name, labels), _ in found.items() if name == "vllm:cache_config_info"]
    assert len(info) == 1
    assert info[0]["block_size"] == "16"  # the CLI's default --block-size
    assert int(info[0]["num_gpu_blocks"]) > 0
