"""Case 12: 2,000 concurrent streams on the null executor all complete, and the server's file
descriptors, threads and memory come back to where they were.

The client is raw trio sockets in this process (httpx would spend the two cores on itself).
The baseline is taken after a warm-up round, so that what the first round allocates once
(the allocator's arenas, trio's thread cache) is not counted as growth; the 2,000-stream
round then runs five times, and the four after the first may not all grow the server
(measured: the first round grows it by 30-60 MiB of allocator arenas, later rounds by about
0.1-1 MiB each here).
"""

from __future__ import annotations

import itertools
import json
import resource
import time
from collections.abc import Iterator

import httpx
import pytest
import trio

from ..http.conftest import Server
from .figures import record
from .http_harness import (
    ProcessFigures,
    held,
    null_args,
    open_sse,
    port_of,
    process_figures,
    scrape,
    serving,
    tiny_model_dir,
)

NUM_STREAMS = 2000
ROUNDS = 5  # the first, and four to tell a leak from the allocator's noise
TOKENS = 8
BODY = json.dumps(
    {"prompt": "many", "max_tokens": TOKENS, "stream": True, "ignore_eos": True}
).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < NUM_STREAMS + 500:  # this process holds the client ends
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    args = ("--max-queued-requests", str(2 * NUM_STREAMS))
    with serving(tiny_model_dir(tmp_path_factory), *null_args(0.005), *args) as server:
        yield server


async def run_streams(port: int, count: int) -> tuple[float, int]:
    """`count` concurrent streams to the end; (seconds, streams that ended with [DONE])."""
    done = 0

    async def one() -> None:
        nonlocal done
        reader = await open_sse(port, "/v1/completions", BODY)
        async with reader.stream:
            assert await reader.read_status() == 200
            events = await reader.events()
        tokens = [e for e in events if e.startswith(b"{")]
        assert events[-1] == b"[DONE]" and b'"finish_reason":"length"' in tokens[-1]
        done += 1

    started = time.monotonic()
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
    return time.monotonic() - started, done


def settled(server: Server, baseline: ProcessFigures | None = None) -> ProcessFigures:
    """The server's figures once no request is held anywhere and its connections have closed:
    back at `baseline` (when given), or unchanged for 2 s (30 s at most)."""
    deadline = time.monotonic() + 30
    with httpx.Client() as client:
        while any(held(scrape(server, client)).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
    figures, unchanged_since = process_figures(server.process.pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = process_figures(server.process.pid)
        if baseline is not None and now.fds <= baseline.fds and now.threads <= baseline.threads:
            return now
        if (now.fds, now.threads) != (figures.fds, figures.threads):
            figures, unchanged_since = now, time.monotonic()
        elif baseline is None and time.monotonic() - unchanged_since > 2:
            return now
    return process_figures(server.process.pid)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_2000_concurrent_streams_complete_and_resources_return(server: Server) -> None:
    port = port_of(server)
    trio.run(run_streams, port, 200)  # warm-up
    baseline = settled(server)
    rounds: list[tuple[float, int, ProcessFigures]] = []
    for _ in range(ROUNDS):
        seconds, done = trio.run(run_streams, port, NUM_STREAMS)
        rounds.append((seconds, done, settled(server, baseline)))
    assert [done for _, done, _ in rounds] == [NUM_STREAMS] * ROUNDS
    last = rounds[-1][2]
    record(12, f"{NUM_STREAMS} concurrent streams of {TOKENS} tokens, wall time", rounds[0][0], "s")
    record(12, "again, wall time", rounds[1][0], "s")
    record(12, "server file descriptors: baseline, after", baseline.fds, f"-> {last.fds}")
    record(12, "server threads: baseline, after", baseline.threads, f"-> {last.threads}")
    mib = 2**20
    rss = [baseline.rss_bytes] + [figures.rss_bytes for _, _, figures in rounds]
    growth = [after - before for before, after in itertools.pairwise(rss)]
    record(12, "server RSS growth, first round", growth[0] / mib, "MiB")
    for number, grown in enumerate(growth[1:], 2):
        record(12, f"server RSS growth, round {number}", grown / mib, "MiB")
    assert last.fds <= baseline.fds
    assert last.threads <= baseline.threads
    assert last.rss_bytes - baseline.rss_bytes < 96 * mib
    # A leak of 4 KiB a request grows every round by 8 MiB. The allocator's noise (glibc's
    # per-thread arenas, the offload threads landing in one or another) moves a round by up to
    # about 22 MiB, and has moved two rounds in a row by 8.9-11.6 MiB (CI, stop 33), never four.
    assert min(growth[1:]) < 8 * mib, "the server's memory grew every round: a leak"
