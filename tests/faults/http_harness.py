"""What the HTTP fault cases share: a `trillm serve` that is always cleaned up, a scrape of
/metrics, process figures from /proc, and a raw-socket SSE client.

The raw client exists because the cases need what a library client hides: closing a socket
at an exact point of a stream (after so many bytes, with a FIN or a RST), not reading at all,
and holding thousands of streams from one process on two cores.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from ..gpu.conftest import save_tiny
from ..http.conftest import Server, free_port, serve_command, wait_healthy
from ..procs import children

_TINY: list[Path] = []


def tiny_model_dir(factory: Any) -> Path:
    """The tiny Llama of tests/http, made once per session (`factory`: tmp_path_factory)."""
    if not _TINY:
        _TINY.append(save_tiny(factory.mktemp("faults-http-tiny"), "llama"))
    return _TINY[0]


def null_args(step_time: float = 0.005) -> tuple[str, ...]:
    """`trillm serve` flags for the null executor (no model: the host side runs for real)."""
    return ("--executor", "null", "--null-step-time", str(step_time))


@contextmanager
def serving(
    model: Path,
    *args: str,
    umask: int = -1,
    start_timeout: float = 120,
) -> Iterator[Server]:
    """`trillm serve model *args` on a free port, healthy; killed (engine too) on the way out.

    No `--host` unless `args` has one: the CLI's default bind is part of what is tested.
    `umask` (-1: inherited) is the server's, to show its shared memory ignores it.
    """
    port = free_port()
    command = serve_command(model, port, *args)
    process = subprocess.Popen(command, env=dict(os.environ), umask=umask)
    server = Server(process, f"http://127.0.0.1:{port}")
    try:
        wait_healthy(process, server.base_url, start_timeout)
        yield server
    finally:
        _kill(process)


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server and its engine if they are still there (a test's own stop came
    first when it passed)."""
    engines = children(process.pid) if process.poll() is None else []
    if process.poll() is None:
        process.kill()
    process.wait()
    for pid in engines:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def port_of(server: Server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


# -- /metrics and /proc ---------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name: value}, the series of one name summed (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def scrape(server: Server, client: httpx.Client | None = None) -> dict[str, float]:
    get = client.get if client is not None else httpx.get
    response = get(f"{server.base_url}/metrics", timeout=10)
    response.raise_for_status()
    return parse_metrics(response.text)


async def scrape_async(server: Server, client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get(f"{server.base_url}/metrics", timeout=10)
    response.raise_for_status()
    return parse_metrics(response.text)


#: The gauges that say a request is still held somewhere: in the engine's queues, in the
#: frontend's request states, or in the HTTP layer's in-flight count.
HELD = (
    "trillm:num_requests_running",
    "trillm:num_requests_waiting",
    "trillm:frontend_request_states",
    "trillm:http_requests_in_flight",
)


def held(metrics: dict[str, float]) -> dict[str, float]:
    return {name: metrics[name] for name in HELD}


@dataclass(frozen=True)
class ProcessFigures:
    """What a process holds: open file descriptors, threads, resident memory."""

    fds: int
    threads: int
    rss_bytes: int


def process_figures(pid: int) -> ProcessFigures:
    threads = rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return ProcessFigures(len(os.listdir(f"/proc/{pid}/fd")), threads, rss)


# -- a raw HTTP/1.1 client on trio sockets --------------------------------------------------


def request_bytes(
    port: int, path: str, body: bytes, *, headers: dict[str, str] | None = None
) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def connect_small(port: int, receive_buffer: int = 4096) -> trio.SocketStream:
    """A connection with a small receive buffer: a client that stops reading fills it (and
    the server's send buffer) after a few kilobytes, so the server's writes block."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


def set_reset_on_close(stream: trio.SocketStream) -> None:
    """Make `close()` send a RST instead of a FIN (SO_LINGER 0), as a crashed client does."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def dechunk(data: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (as far as `data` goes)."""
    out, rest = b"", data
    while b"\r\n" in rest:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


class SSEReader:
    """Reads an SSE response from a raw stream: status, then `data:` events as they come.

    Chunked framing is stripped only as far as finding events needs: every event the server
    sends is one chunk, and an event never contains CRLF.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.status: int | None = None
        self.num_bytes = 0

    async def _more(self) -> bool:
        data = await self.stream.receive_some(65536)
        self.buffer += data
        self.num_bytes += len(data)
        return bool(data)

    async def read_status(self) -> int:
        while b"\r\n\r\n" not in self.buffer:
            if not await self._more():
                raise ConnectionError("the server closed before the response head")
        head, _, rest = bytes(self.buffer).partition(b"\r\n\r\n")
        self.buffer = bytearray(rest)
        self.head = head.decode("latin1")
        self.status = int(self.head.split(" ", 2)[1])
        return self.status

    async def next_event(self) -> bytes | None:
        """The next event's data (b"[DONE]" last), or None when the server closed."""
        while True:
            start = self.buffer.find(b"data: ")
            end = self.buffer.find(b"\n\n", start) if start >= 0 else -1
            if end >= 0:
                event = bytes(self.buffer[start + 6 : end])
                del self.buffer[: end + 2]
                return event
            if not await self._more():
                return None

    async def events(self) -> list[bytes]:
        """Every remaining event up to and including [DONE] (or the close)."""
        out = []
        while (event := await self.next_event()) is not None:
            out.append(event)
            if event == b"[DONE]":
                break
        return out


async def open_sse(port: int, path: str, body: bytes) -> SSEReader:
    stream = await connect(port)
    await stream.send_all(request_bytes(port, path, body))
    return SSEReader(stream)
