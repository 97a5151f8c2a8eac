"""What the process fault cases share: a `trillm serve` whose whole process tree is known and
always killed, its output kept for the assertions, and /dev/shm and /proc facts.

`tests/faults/http_harness.py` has the raw SSE client and the tiny model these cases reuse;
this module adds what killing processes needs: the tree's pids (frontend, engine, workers),
the server's stderr, and waits that are bounded and fail with what was seen.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from ..http.conftest import free_port, serve_command, wait_healthy
from ..procs import children, is_dead
from .http_harness import SSEReader, open_sse

SHM = Path("/dev/shm")


@dataclass
class Served:
    """One `trillm serve` process and everything it started."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    seen: set[int] = field(default_factory=set)  # every pid of the tree ever looked up

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        """What the server (and its engine and workers) wrote to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def tree(self) -> list[int]:
        """The frontend and its descendants now (remembered for the cleanup)."""
        pids = [self.pid]
        for pid in pids:
            pids += children(pid)
        self.seen.update(pids)
        return pids

    def engine_pid(self) -> int:
        (engine,) = children(self.pid)
        self.seen.add(engine)
        return engine

    def worker_pids(self) -> list[int]:
        """The engine's worker processes (TP > 1), in rank order (they are spawned in order)."""
        workers = sorted(children(self.engine_pid()))
        self.seen.update(workers)
        return workers

    def wait_exit(self, timeout: float) -> int:
        """The server's exit status; fails (with its output) if it is still running."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the server did not exit within {timeout} s; its output:\n{self.output()}"
            ) from None


@contextmanager
def served(
    model: Path | str, *args: str, healthy: bool = True, start_timeout: float = 120
) -> Iterator[Served]:
    """`trillm serve model *args` on a free port (healthy first, unless `healthy` is False);
    on the way out every process of its tree is SIGKILLed and waited for."""
    port = free_port()
    fd, log_name = tempfile.mkstemp(prefix="trillm-serve-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(
            serve_command(model, port, *args), stdout=log, stderr=subprocess.STDOUT
        )
    server = Served(process, port, Path(log_name))
    try:
        server.tree()
        if healthy:
            wait_healthy(process, server.base_url, start_timeout, lambda: f":\n{server.output()}")
            server.tree()
        yield server
    finally:
        kill_tree(server)
        if sys.exc_info()[0] is not None:  # a failure: show what the server said
            print(f"--- trillm serve output ---\n{server.output()}", file=sys.stderr)
        os.unlink(log_name)


def kill_tree(server: Served) -> None:
    """SIGKILL every process of the tree still there, and wait (bounded) until all are gone."""
    pids = set(server.tree()) | server.seen
    for pid in pids:
        if not is_dead(pid):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    server.process.wait()
    wait_dead(pids, 10)


def wait_dead(pids: set[int] | list[int], timeout: float) -> float:
    """Seconds until every pid is gone or a zombie; fails naming the survivors."""
    started = time.monotonic()
    while True:
        alive = [pid for pid in pids if not is_dead(pid)]
        if not alive:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"processes {alive} are still alive after {timeout} s")
        time.sleep(0.005)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition()` holds; fails with `what` after `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.005)
    return time.monotonic() - started


def shm_names_of(pids: set[int] | list[int]) -> list[str]:
    """/dev/shm entries whose name carries one of `pids` (trillm's `trillm-<pid>-<hex>`, and
    any other library's name with a pid in it)."""
    wanted = {str(pid) for pid in pids}
    return sorted(name for name in os.listdir(SHM) if wanted.intersection(re.split(r"[-_.]", name)))


def health(server: Served) -> int:
    return httpx.get(f"{server.base_url}/health", timeout=10).status_code


def health_or_0(server: Served) -> int:
    """/health's status, 0 while the server does not answer (restarting or gone)."""
    try:
        return httpx.get(f"{server.base_url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


async def wait_restarted(
    server: Served, dead: int, timeout: float = 120, seen: list[int] | None = None
) -> int:
    """The new engine's pid, once /health is 200 again on an engine other than `dead`; each
    poll's /health status is appended to `seen`.

    The children are read before /health is asked: a 200 answered before the frontend saw the
    death, read with children listed after it had spawned the new engine, would hand back an
    engine still starting (and `seen` no 503). The frontend spawns a new engine only once it
    is restarting, so /health is 503 until that engine serves."""
    polls = [] if seen is None else seen

    def serving_again() -> bool:
        engines = children(server.pid)
        polls.append(health_or_0(server))
        return polls[-1] == 200 and any(pid != dead for pid in engines)

    await trio.to_thread.run_sync(lambda: wait_for(serving_again, timeout, "a restarted engine"))
    new = server.engine_pid()
    assert new != dead
    return new


def completion(server: Served, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", **body}, timeout=30)


# -- streams ---------------------------------------------------------------------------------


@dataclass
class Stream:
    """One SSE completion stream read as it comes: when it ended, with what error."""

    index: int
    num_tokens: int = 0
    error: str | None = None
    ended_at: float | None = None  # time.monotonic() of [DONE] or the close


async def run_streams(
    server: Served,
    n: int,
    *,
    max_tokens: int,
    flowing: trio.Event,
    streams: list[Stream],
) -> None:
    """Open `n` streaming completions and read them to their end; set `flowing` once every
    one has received a token (so all are open when the caller strikes)."""
    body = json.dumps(
        {"prompt": "x", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    waiting = set(range(n))

    async def one(stream: Stream) -> None:
        reader: SSEReader = await open_sse(server.port, "/v1/completions", body)
        async with reader.stream:
            status = await reader.read_status()
            if status != 200:
                stream.error = f"status {status}"
                stream.ended_at = time.monotonic()
                return
            while (event := await reader.next_event()) is not None:
                if event == b"[DONE]":
                    break
                if event.startswith(b'{"error"'):
                    stream.error = json.loads(event)["error"]["message"]
                else:
                    stream.num_tokens += 1
                    waiting.discard(stream.index)
                    if not waiting:
                        flowing.set()
            stream.ended_at = time.monotonic()

    streams[:] = [Stream(i) for i in range(n)]
    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(one, stream)


async def strike_during_streams(
    server: Served, strike: Callable[[], object], *, n: int = 64, limit: float = 90
) -> tuple[list[Stream], list[float], float]:
    """Open `n` long streams, call `strike()` once all are flowing, read them to their end.

    Returns the streams; for each that ended, the seconds from the strike to its end; and
    the strike's `time.monotonic()`.
    """
    streams: list[Stream] = []
    flowing = trio.Event()
    with trio.fail_after(limit):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: run_streams(server, n, max_tokens=480, flowing=flowing, streams=streams)
            )
            await flowing.wait()
            struck = time.monotonic()
            strike()
    return streams, [s.ended_at - struck for s in streams if s.ended_at is not None], struck


@dataclass
class Resumed:
    """What streams that ran through a strike (a kill, a stop) got: their text, the error
    events, and the seconds from the strike to the first token after it (None: none came)."""

    texts: list[str]
    errors: list[str]
    first_after_strike: float | None


async def completion_texts(
    client: httpx.AsyncClient,
    url: str,
    prompts: list[str] | list[list[int]],
    body: dict[str, object],
) -> list[str]:
    """The text of a completion of each prompt, all sent at once (not streamed)."""
    texts = [""] * len(prompts)

    async def one(i: int) -> None:
        reply = await client.post(url, json={"prompt": prompts[i], **body})
        texts[i] = reply.json()["choices"][0]["text"]

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return texts


async def stream_through_strike(
    client: httpx.AsyncClient,
    url: str,
    prompts: list[str] | list[list[int]],
    body: dict[str, object],
    strike: Callable[[], None],
) -> Resumed:
    """Stream a completion of each prompt; once every stream has a token, `strike()`; read
    them all to their end."""
    texts = [""] * len(prompts)
    errors: list[str] = []
    flowing = trio.Event()
    started: set[int] = set()
    struck_at: list[float] = []
    after: list[float] = []

    async def one(i: int) -> None:
        request = {"prompt": prompts[i], "stream": True, **body}
        async with client.stream("POST", url, json=request) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"]["message"])
                    continue
                texts[i] += event["choices"][0]["text"]
                if struck_at and not after:
                    after.append(time.monotonic() - struck_at[0])
                started.add(i)
                if len(started) == len(prompts):
                    flowing.set()

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
        await flowing.wait()
        struck_at.append(time.monotonic())
        strike()
    return Resumed(texts, errors, after[0] if after else None)
