"""A client that goes away from /v1/embeddings, /score or /rerank is aborted in the engine, as
one from a generation route is, and leaves nothing behind.

The server runs the null executor (50 ms steps) with a 4-token step budget, so a 400-token
input needs 100 steps (5 s) once admitted: gone from the engine sooner than that, it was
aborted, not finished.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from ..http.conftest import Server
from .http_harness import (
    connect,
    held,
    null_args,
    port_of,
    request_bytes,
    scrape_async,
    serving,
    tiny_model_dir,
)

LONG = list(range(100, 500))  # 400 token ids: 100 steps of 4 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model: Path = tiny_model_dir(tmp_path_factory)
    args = (*null_args(0.05), "--max-num-batched-tokens", "4", "--max-model-len", "512")
    with serving(model, *args) as server:
        yield server


async def wait_until(server: Server, client: httpx.AsyncClient, done: object) -> dict[str, float]:
    with trio.fail_after(10):
        while True:
            metrics = await scrape_async(server, client)
            if done(metrics):  # type: ignore[operator]
                return metrics
            await trio.sleep(0.01)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": LONG}),
        # The null executor pools nothing: the long input goes first, and the client with it.
        ("/score", {"text_1": "one " * 400, "text_2": ["two"]}),
        ("/rerank", {"query": "one " * 400, "documents": ["two", "three"]}),
    ],
)
async def test_a_disconnect_aborts_the_pooling_requests(
    server: Server, path: str, body: dict[str, object]
) -> None:
    port = port_of(server)
    async with httpx.AsyncClient() as client:
        baseline = await wait_until(server, client, lambda m: not any(held(m).values()))
        connection = await connect(port)
        await connection.send_all(request_bytes(port, path, json.dumps(body).encode()))
        await wait_until(server, client, lambda m: m["trillm:num_requests_running"] >= 1)
        await connection.aclose()
        gone = time.monotonic()
        after = await wait_until(server, client, lambda m: not any(held(m).values()))
        # Finishing would have taken 100 steps of 50 ms after admission.
        assert time.monotonic() - gone < 2.5
        assert after["trillm:kv_cache_free_blocks"] == baseline["trillm:kv_cache_free_blocks"]
        assert after.get("trillm:pooling_requests_total", 0) == baseline.get(
            "trillm:pooling_requests_total", 0
        )
