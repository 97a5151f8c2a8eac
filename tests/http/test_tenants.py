"""Over HTTP, against two engines (`--data-parallel-size 2`): a request pinned by vLLM's
`X-data-parallel-rank` header or the body's `data_parallel_rank` runs on that engine, and
`cache_salt` isolates tenants, as each engine's prefix-cache counters in /metrics show."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Server, start_server
from .test_metrics_vllm import samples

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(100, 141))  # 41 token ids, blocks of 16: 32 can hit
ROUTES = [
    ("completions", {"prompt": "hi"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.fixture(scope="module")
def two_engines(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--data-parallel-size", "2")
    try:
        yield server
    finally:
        server.stop()


def counters(server: Server) -> dict[tuple[str, str], float]:
    """(name, engine) -> value of the prefix-cache counters."""
    found = samples(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    return {
        (name.removeprefix("vllm:prefix_cache_").removesuffix("_total"), dict(labels)["engine"]): v
        for (name, labels), v in found.items()
        if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    }


def complete(server: Server, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body}
    url = f"{server.base_url}/v1/completions"
    return httpx.post(url, json=body, headers=headers or {}, timeout=60)


def test_the_header_and_the_body_field_pin_the_engine(two_engines: Server) -> None:
    for pin, engine in (({"headers": {"X-data-parallel-rank": "1"}}, "1"),
                        ({"data_parallel_rank": 0}, "0"),
                        ({"headers": {"x-data-parallel-rank": "1"}}, "1")):  # fmt: skip
        before = counters(two_engines)
        assert complete(two_engines, **pin).status_code == 200
        after = counters(two_engines)
        other = "0" if engine == "1" else "1"
        assert after["queries", engine] - before["queries", engine] == len(PROMPT)
        assert after["queries", other] == before["queries", other]


TEXT = "the header pins this request to one engine of two " * 3
FACES = [
    ("completions", {"prompt": TEXT, "max_tokens": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 2}),
    ("responses", {"input": TEXT, "max_output_tokens": 2}),
    ("messages", {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 2}),
    ("embeddings", {"input": TEXT}),
]


@pytest.mark.parametrize(("route", "body"), FACES, ids=[route for route, _ in FACES])
def test_every_face_runs_on_the_engine_its_header_pins(
    two_engines: Server, route: str, body: dict[str, Any]
) -> None:
    """Completions, chat, Responses, Messages and embeddings alike: the header's engine
    looks the prompt up in its prefix cache, the other engine sees nothing."""
    for engine, other in (("1", "0"), ("0", "1")):
        before = counters(two_engines)
        response = httpx.post(
            f"{two_engines.base_url}/v1/{route}",
            json={"model": "tiny", "temperature": 0, **body},
            headers={"X-data-parallel-rank": engine},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        after = counters(two_engines)
        assert after["queries", engine] > before["queries", engine], (route, engine)
        assert after["queries", other] == before["queries", other], (route, engine)


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"X-data-parallel-rank": "first"}, {}, "X-data-parallel-rank"),
        ({"X-data-parallel-rank": "2"}, {}, "X-data-parallel-rank"),
        ({}, {"data_parallel_rank": -1}, "data_parallel_rank"),
        ({}, {"cache_salt": ""}, "cache_salt"),
    ],
)
def test_a_bad_rank_or_salt_is_a_400_naming_it(
    two_engines: Server, headers: dict[str, str], body: dict[str, Any], param: str
) -> None:
    for route, fields in ROUTES:
        response = httpx.post(
            f"{two_engines.base_url}/v1/{route}",
            json={**fields, "max_tokens": 2, **body},
            headers=headers,
            timeout=60,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_cache_salts_isolate_tenants_as_the_hit_counters_show(two_engines: Server) -> None:
    """All on engine 0 (pinned): the same prompt and salt hit; another salt misses; no salt
    is a tenant of its own."""
    grown = []
    for salt in ("tenant-a", "tenant-a", "tenant-b", None, None):
        before = counters(two_engines)["hits", "0"]
        salted = {} if salt is None else {"cache_salt": salt}
        assert complete(two_engines, data_parallel_rank=0, **salted).status_code == 200
        grown.append(counters(two_engines)["hits", "0"] - before)
    # The unsalted prompt ran on engine 0 in the test above: its blocks may be cached already.
    assert grown[:3] == [0, 32, 0] and grown[4] == 32
