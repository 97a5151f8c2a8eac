"""Case 11: beyond `--max-queued-requests`, a request is refused at once with 429 and
`Retry-After`; the requests admitted (running or queued in the engine) are all served.

A burst of 40 concurrent requests (streaming and not) meets a limit of 8, with the engine
running 2 at a time (`--max-num-seqs 2`), so 6 of the admitted wait in the engine's queue.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import trio

from ..http.conftest import Server
from .figures import record
from .http_harness import SSEReader, connect, dechunk, null_args, port_of, request_bytes, serving
from .http_harness import tiny_model_dir as tiny

LIMIT = 8
BURST = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--max-queued-requests", str(LIMIT), "--max-num-seqs", "2")
    with serving(tiny(tmp_path_factory), *null_args(0.01), *args) as server:
        yield server


Result = tuple[int, float, str, bytes, float]  # status, answered after, head, body, done at


async def one(port: int, stream: bool, results: list[Result]) -> None:
    body = json.dumps(
        {"prompt": "queue", "max_tokens": 40, "stream": stream, "ignore_eos": True}
    ).encode()
    connection = await connect(port)
    async with connection:
        started = time.monotonic()
        await connection.send_all(request_bytes(port, "/v1/completions", body))
        reader = SSEReader(connection)
        status = await reader.read_status()
        answered = time.monotonic() - started
        rest = bytes(reader.buffer)
        while not rest.endswith(b"\r\n0\r\n\r\n"):  # the last chunk (both are chunked)
            chunk = await connection.receive_some(65536)
            if not chunk:
                break
            rest += chunk
        results.append((status, answered, reader.head, rest, time.monotonic()))


async def test_a_burst_beyond_the_limit_is_refused_at_once_and_the_admitted_all_served(
    server: Server,
) -> None:
    port = port_of(server)
    results: list[Result] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(BURST):
                nursery.start_soon(one, port, i % 4 != 0, results)
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(results) == BURST and len(served) + len(refused) == BURST, [r[0] for r in results]
    assert len(served) == LIMIT  # each takes >= 0.4 s: none ended before the burst was in
    for _, _, head, rest, _ in refused:
        assert "retry-after: 1" in head.lower()
        error = json.loads(dechunk(rest))["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "overloaded"
    for _, _, head, rest, _ in served:
        if "text/event-stream" in head:
            assert b"data: [DONE]" in rest and b'"finish_reason":"length"' in rest
        else:
            assert json.loads(dechunk(rest))["usage"]["completion_tokens"] == 40
    slowest_refusal = max(answered for _, answered, _, _, _ in refused)
    record(
        11,
        f"429 with Retry-After for a burst of {BURST} over a limit of {LIMIT}, slowest",
        slowest_refusal * 1e3,
        "ms",
    )
    record(
        11, "admitted requests served (2 running, the rest queued in the engine)", len(served), ""
    )
    # Refused at once: every 429 was whole before the first admitted request (>= 0.4 s of
    # steps) was done, so no refusal waited for a slot to free up.
    assert max(done for *_, done in refused) < min(done for *_, done in served)
