"""Case 9: a client that stops reading costs bounded memory, stalls no other stream, and
does not hold a graceful shutdown.

The slow clients connect with a 4 KiB receive buffer and never read, so the server's writes
block after a few kilobytes; `--write-timeout 2` then drops them (their requests are aborted
in the engine). The null executor makes the streams long enough to block.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import trio

from ..http.conftest import Server
from .figures import record
from .http_harness import (
    connect_small,
    held,
    null_args,
    open_sse,
    port_of,
    process_figures,
    request_bytes,
    scrape_async,
    serving,
    tiny_model_dir,
)

WRITE_TIMEOUT = 2.0
NUM_SLOW = 16
SLOW_BODY = json.dumps(
    {
        "prompt": "flood",
        "max_tokens": 400,
        "n": 4,
        "logprobs": 5,
        "stream": True,
        "ignore_eos": True,
    }
).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_model_dir(tmp_path_factory)
    with serving(model, *null_args(0.005), "--write-timeout", str(WRITE_TIMEOUT)) as server:
        yield server


async def start_slow_reader(port: int) -> trio.SocketStream:
    stream = await connect_small(port)
    await stream.send_all(request_bytes(port, "/v1/completions", SLOW_BODY))
    return stream


async def test_a_client_that_stops_reading_is_dropped_without_stalling_others(
    server: Server,
) -> None:
    port, pid = port_of(server), server.process.pid
    async with httpx.AsyncClient() as client:
        rss_before = process_figures(pid).rss_bytes
        started = time.monotonic()
        slow = [await start_slow_reader(port) for _ in range(NUM_SLOW)]
        # Wait until every slow stream is generating (their writes soon block).
        with trio.fail_after(10):
            while (await scrape_async(server, client))["trillm:http_requests_in_flight"] < NUM_SLOW:
                await trio.sleep(0.02)
        await trio.sleep(0.5)

        # A normal stream meanwhile: 100 tokens at 5 ms steps, read as they come.
        reader = await open_sse(
            port,
            "/v1/completions",
            json.dumps(
                {"prompt": "fine", "max_tokens": 100, "stream": True, "ignore_eos": True}
            ).encode(),
        )
        assert await reader.read_status() == 200
        gaps, last, events = [], time.monotonic(), []
        peak_rss = process_figures(pid).rss_bytes
        with trio.fail_after(10):
            while (event := await reader.next_event()) is not None:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                events.append(event)
                peak_rss = max(peak_rss, process_figures(pid).rss_bytes)
                if event == b"[DONE]":
                    break
        await reader.stream.aclose()
        assert events[-1] == b"[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

        # The slow ones are dropped once a write waited WRITE_TIMEOUT, and leave nothing.
        with trio.fail_after(WRITE_TIMEOUT + 10):
            while True:
                metrics = await scrape_async(server, client)
                peak_rss = max(peak_rss, process_figures(pid).rss_bytes)
                if not any(held(metrics).values()):
                    break
                await trio.sleep(0.05)
        dropped_after = time.monotonic() - started
        for stream in slow:  # the server closed them: what arrived ends without [DONE]
            received = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    received += chunk
            assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
            await stream.aclose()
    growth = (peak_rss - rss_before) / 2**20
    record(9, f"server memory growth with {NUM_SLOW} stalled n=4 streams, peak", growth, "MiB")
    record(9, "largest gap between events of a normal stream meanwhile", max(gaps) * 1e3, "ms")
    record(
        9,
        f"stalled streams dropped and aborted (--write-timeout {WRITE_TIMEOUT:g})",
        dropped_after,
        "s",
    )
    assert growth < 64
    assert max(gaps) < 0.5  # 5 ms steps: no stall behind the blocked writers
    assert dropped_after < WRITE_TIMEOUT + 8


@pytest.mark.slow
def test_a_client_that_stops_reading_does_not_hold_a_graceful_shutdown(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    shutdown_timeout = 1.0
    with serving(
        model, *null_args(0.005), "--write-timeout", "600", "--shutdown-timeout", "1"
    ) as server:
        port = port_of(server)

        async def stall_then_terminate() -> float:
            stream = await start_slow_reader(port)
            async with httpx.AsyncClient() as client:
                with trio.fail_after(10):
                    while not (await scrape_async(server, client))["trillm:num_requests_running"]:
                        await trio.sleep(0.02)
            await trio.sleep(1.0)  # its writes are blocked by now (400 tokens x 4, unread)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            code = await trio.to_thread.run_sync(server.process.wait, 60)
            await stream.aclose()
            assert code == 0
            return time.monotonic() - started

        took = trio.run(stall_then_terminate)
    record(9, "SIGTERM to exit with a stalled reader (--shutdown-timeout 1)", took, "s")
    assert took < shutdown_timeout + 30  # not held by the stalled writes (write timeout 600 s)
