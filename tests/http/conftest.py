from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest

from ..gpu.conftest import save_tiny


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    base_url: str

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def serve_command(model: Path | str, port: int, *args: str) -> list[str]:
    """`trillm serve` of a test model on `port` (float32, a 32 MiB KV cache), plus `args`.

    Without engine restarts unless `args` ask for them (`--max-engine-restarts`): the death
    cases check what a death does, not what a restart hides. For the same reason, and so that
    the process started is the API server itself (its pid, children, fds and title are what
    the cases read), without the API supervisor unless `args` ask for it
    (`--max-api-restarts`; tests/faults/test_redteam_crash.py)."""
    restarts = () if "--max-engine-restarts" in args else ("--no-engine-restart",)
    supervised = () if "--max-api-restarts" in args else ("--max-api-restarts", "0")
    return [
        sys.executable, "-m", "trillm.cli", "serve", str(model), "--port", str(port),
        "--served-model-name", "tiny", "--kv-cache-memory-bytes", str(1 << 25),
        "--dtype", "float32", *restarts, *supervised, *args,
    ]  # fmt: skip


def start_server(
    model: Path, *args: str, env: dict[str, str] | None = None, stderr: IO[bytes] | None = None
) -> Server:
    """`trillm serve` in a subprocess, healthy; `env` adds to the environment."""
    port = free_port()
    process = subprocess.Popen(
        serve_command(model, port, *args), env={**os.environ, **(env or {})}, stderr=stderr
    )
    server = Server(process, f"http://127.0.0.1:{port}")
    wait_healthy(process, server.base_url, 120)
    return server


def wait_healthy(
    process: subprocess.Popen[bytes],
    base_url: str,
    timeout: float,
    describe: Callable[[], str] = str,
) -> None:
    """Until `GET /health` answers 200; fails if the server exits or the time is up.

    `describe()` adds to the failure's message (the server's output, when it was kept).
    """
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise AssertionError(
                f"the server exited during start-up ({process.returncode}){describe()}"
            )
        with suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"the server was not healthy in {timeout} s{describe()}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("http-tiny"), "llama")


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--max-queued-requests", "64")
    try:
        yield server
    finally:
        server.stop()
