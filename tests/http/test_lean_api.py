"""The API process stays small: serving a request loads no torch, and its RSS stays under
150 MiB (DESIGN.md §8; it was about 450 MiB when the frontend imported the device side)."""

from __future__ import annotations

from pathlib import Path

import httpx

from ..faults.http_harness import process_figures
from .conftest import start_server

MAX_API_RSS_MIB = 150


def mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {Path(line.split()[-1]).name for line in f if line.rstrip().endswith(".so")}


def test_the_api_process_serves_without_torch_in_under_150_mib(tiny_model: Path) -> None:
    server = start_server(tiny_model)
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
        assert response.status_code == 200, response.text
        torch_libraries = {n for n in mapped_libraries(server.process.pid) if "torch" in n}
        assert not torch_libraries, f"the API process mapped {sorted(torch_libraries)}"
        rss = process_figures(server.process.pid).rss_bytes / 2**20
        assert rss < MAX_API_RSS_MIB, f"the API process holds {rss:.0f} MiB after two requests"
    finally:
        server.stop()
