"""The control endpoints (`--enable-dev-endpoints`) and the process titles, against real
`trillm serve` processes: the tiny model where output matters, the null executor where not."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..procs import children
from .conftest import Server, start_server

KEY = "dev-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KV_BYTES = 256 << 20  # large enough that freeing it shows in the engine's RSS
PROMPT = {"model": "tiny", "prompt": "Once upon", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def dev_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    traces = tmp_path_factory.mktemp("traces")
    server = start_server(
        tiny_model,
        "--enable-dev-endpoints",
        "--api-key", KEY,
        "--profiler-dir", str(traces),
        "--kv-cache-memory-bytes", str(KV_BYTES),
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def post(server: Server, path: str, **kw: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", headers=AUTH, timeout=60, **kw)  # type: ignore[arg-type]


def get(server: Server, path: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}{path}", headers=AUTH, timeout=60)


def complete(server: Server) -> str:
    response = post(server, "/v1/completions", json={**PROMPT, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def engine_pid(server: Server) -> int:
    (pid,) = children(server.process.pid)
    return pid


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def ps_args(pid: int) -> str:
    """What `ps -o args` prints for `pid`."""
    out = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.mark.timeout(60)
def test_without_the_flag_the_routes_do_not_exist(server: Server) -> None:
    for method, path in (("POST", "/sleep"), ("GET", "/is_sleeping"), ("POST", "/pause")):
        response = httpx.request(method, f"{server.base_url}{path}", timeout=30)
        assert response.status_code == 404
        assert response.json()["error"]["message"] == f"route {path} does not exist"


@pytest.mark.timeout(60)
def test_the_routes_need_the_api_key(dev_server: Server) -> None:
    for method, path in (
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/start_profile"),
        ("POST", "/stop_profile"),
    ):
        response = httpx.request(method, f"{dev_server.base_url}{path}", timeout=30)
        assert response.status_code == 401, path
    assert get(dev_server, "/is_sleeping").json() == {"is_sleeping": False}


@pytest.mark.timeout(60)
def test_ps_shows_the_api_and_engine_titles(dev_server: Server) -> None:
    assert ps_args(dev_server.process.pid) == "trillm::api"
    assert ps_args(engine_pid(dev_server)) == "trillm::engine"


@pytest.mark.timeout(60)
def test_reset_prefix_cache(dev_server: Server) -> None:
    complete(dev_server)
    response = post(dev_server, "/reset_prefix_cache")
    assert (response.status_code, response.json()) == (200, {"reset": True})


@pytest.mark.timeout(120)
def test_sleep_frees_the_kv_cache_and_wake_up_serves_the_same_text(dev_server: Server) -> None:
    before = complete(dev_server)
    pid = engine_pid(dev_server)
    awake = rss_bytes(pid)
    response = post(dev_server, "/sleep", params={"level": "1"})
    assert response.status_code == 200, response.text
    assert response.json() == {"is_sleeping": True, "level": 1, "num_aborted": 0}
    asleep = rss_bytes(pid)
    assert awake - asleep > 0.8 * KV_BYTES, (awake, asleep)  # the KV cache went back
    assert get(dev_server, "/is_sleeping").json() == {"is_sleeping": True}
    refused = post(dev_server, "/v1/completions", json=PROMPT)
    assert refused.status_code == 503
    assert refused.json()["error"] == {
        "message": "the engine is asleep (POST /sleep, level 1): its KV cache is freed; "
        "POST /wake_up to serve again",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert post(dev_server, "/tokenize", json={"prompt": "still"}).status_code == 200
    response = post(dev_server, "/wake_up")
    assert (response.status_code, response.json()) == (200, {"is_sleeping": False})
    assert rss_bytes(pid) - asleep > 0.8 * KV_BYTES  # a zeroed cache of the same size
    assert complete(dev_server) == before
    # Level 2 on CPU: the weights are in host memory already, so it frees what level 1 does.
    assert post(dev_server, "/sleep", params={"level": "2"}).json()["level"] == 2
    assert post(dev_server, "/wake_up").status_code == 200
    assert complete(dev_server) == before


@pytest.mark.timeout(120)
def test_sleep_aborts_the_requests_in_flight(dev_server: Server) -> None:
    body = {**PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = f"{dev_server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        post(dev_server, "/pause")  # so that it is still running at the sleep
        response = post(dev_server, "/sleep")
        assert response.json() == {"is_sleeping": True, "level": 1, "num_aborted": 1}
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest[:-1]]
    assert finish[-1] == "abort"
    assert post(dev_server, "/resume").status_code == 200
    assert post(dev_server, "/wake_up").status_code == 200
    assert complete(dev_server)


@pytest.mark.timeout(60)
def test_a_bad_sleep_level_is_a_400(dev_server: Server) -> None:
    response = post(dev_server, "/sleep", params={"level": "3"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "level must be 1 or 2, got '3'"
    assert response.json()["error"]["param"] == "level"
    assert get(dev_server, "/is_sleeping").json() == {"is_sleeping": False}


@pytest.mark.timeout(120)
def test_pause_holds_a_stream_and_resume_finishes_it_with_the_same_text(
    dev_server: Server,
) -> None:
    body = {**PROMPT, "max_tokens": 48, "ignore_eos": True}
    reference = post(dev_server, "/v1/completions", json=body).json()["choices"][0]["text"]
    chunks: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        url = f"{dev_server.base_url}/v1/completions"
        stream_body = {**body, "stream": True}
        with httpx.stream("POST", url, json=stream_body, headers=AUTH, timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    chunks.put(json.loads(line[6:])["choices"][0]["text"])
        chunks.put(None)

    # Paused before the stream starts: the tiny model streams 48 tokens in a few ms, so a
    # pause sent after its first chunk could come after its last.
    paused = post(dev_server, "/pause")
    assert paused.json() == {"is_paused": True, "num_requests": 0}
    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert get(dev_server, "/is_paused").json() == {"is_paused": True}
        time.sleep(0.7)  # nothing steps while paused: the request waits
        assert chunks.empty()
        assert post(dev_server, "/resume").json() == {"is_paused": False, "num_requests": 1}
        text = []
        while (chunk := chunks.get(timeout=60)) is not None:
            text.append(chunk)
    finally:
        reader.join(timeout=60)
    assert "".join(t for t in text if t) == reference


@pytest.mark.timeout(120)
def test_profile_writes_a_trace_to_the_profiler_dir(dev_server: Server) -> None:
    started = post(dev_server, "/start_profile")
    assert started.status_code == 200, started.text
    again = post(dev_server, "/start_profile")
    assert again.status_code == 400
    assert again.json()["error"]["message"].startswith("a profile is running already")
    complete(dev_server)
    stopped = post(dev_server, "/stop_profile")
    assert stopped.status_code == 200, stopped.text
    (trace,) = stopped.json()["traces"]
    assert stopped.json()["traces"] == started.json()["traces"]
    assert json.loads(Path(trace).read_text())["traceEvents"]
    assert Path(trace).name.startswith(f"trillm-engine-{engine_pid(dev_server)}-")


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_data_parallel_titles_and_controls_reach_every_engine(tiny_model: Path) -> None:
    server = start_server(
        tiny_model,
        "--executor", "null",
        "--data-parallel-size", "2",
        "--enable-dev-endpoints",
    )  # fmt: skip
    try:
        pids = sorted(children(server.process.pid))
        assert sorted(ps_args(pid) for pid in pids) == ["trillm::engine_0", "trillm::engine_1"]
        url = server.base_url
        response = httpx.post(f"{url}/start_profile", timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            "profiling needs a directory for the traces: start the server with --profiler-dir DIR"
        )
        assert httpx.post(f"{url}/pause", timeout=30).json()["is_paused"] is True
        assert httpx.get(f"{url}/is_paused", timeout=30).json() == {"is_paused": True}
        assert httpx.post(f"{url}/resume", timeout=30).status_code == 200
        assert httpx.post(f"{url}/sleep", timeout=30).json()["level"] == 1
        completion = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=30)
        assert completion.status_code == 503
        assert httpx.post(f"{url}/wake_up", timeout=30).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        assert httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=30).status_code == 200
    finally:
        server.stop()
