"""`trillm serve` as a subprocess, driven by the official openai SDK and by httpx."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from trillm.gpu.cpu._cpu_linear import packed_linear_available

from ..procs import children
from .conftest import Server, start_server

GREEDY = {"ignore_eos": True}


def client(server: Server, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", **kw)  # type: ignore[arg-type]


def test_models_lists_the_served_model(server: Server) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_streaming_equals_non_streaming(server: Server) -> None:
    sdk = client(server)
    whole = sdk.completions.create(
        model="tiny", prompt="Hello there", max_tokens=10, temperature=0, extra_body=GREEDY
    )
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    assert whole.choices[0].finish_reason == "length"
    stream = sdk.completions.create(
        model="tiny",
        prompt="Hello there",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_completion_and_its_stream(server: Server) -> None:
    sdk = client(server)
    messages = [{"role": "user", "content": "Say something."}]
    whole = sdk.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    assert whole.choices[0].message.role == "assistant"
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


async def test_async_sdk_streams_chat(server: Server) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    stream = await sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body=GREEDY,
    )
    finish = [c.choices[0].finish_reason async for c in stream if c.choices]
    assert finish[-1] == "length"
    await sdk.close()


def test_n_logprobs_and_echo(server: Server) -> None:
    sdk = client(server)
    out = sdk.completions.create(
        model="tiny",
        prompt="abc",
        max_tokens=4,
        n=2,
        seed=3,
        logprobs=2,
        echo=True,
        extra_body=GREEDY,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert choice.text.startswith("abc")
        assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    chat = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body=GREEDY,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and len(content[0].top_logprobs) == 2


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"prompt": "x", "temperature": -1}', 400, "temperature must be >= 0, got -1"),
        (b'{"model": "other", "prompt": "x"}', 404, "model 'other'"),
        (b'{"prompt": "x", "max_tokens": 100000}', 400, "more than the model's maximum length 512"),
    ],
)
def test_bad_input_gets_an_openai_error_object(
    server: Server, body: bytes, status: int, message: str
) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and {"message", "type", "param", "code"} <= error.keys()


def test_unknown_route_oversized_body_and_request_id(server: Server) -> None:
    assert httpx.get(f"{server.base_url}/v1/nothing").status_code == 404
    big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    assert (
        httpx.post(f"{server.base_url}/v1/completions", content=big, timeout=30).status_code == 413
    )
    r = httpx.get(f"{server.base_url}/version", headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123" and r.json()["version"]
    kernels = r.json()["kernels"]  # float32 packs for oneDNN on any x86-64 CPU
    assert kernels["device"] == "cpu" and kernels["dtype"] == "float32"
    assert kernels["linear"] == ("onednn" if packed_linear_available(torch.float32) else "aten")


def test_tokenize_detokenize_health_and_metrics(server: Server) -> None:
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"].endswith("Hello world")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "trillm:num_requests_running",
        "trillm:kv_cache_usage_perc",
        "trillm:generation_tokens_total",
    ):
        assert name in metrics


def test_a_client_disconnect_aborts_the_request(server: Server) -> None:
    body = {"prompt": "go", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.monotonic() + 5
    while True:
        metrics = httpx.get(f"{server.base_url}/metrics").text
        running = [
            line for line in metrics.splitlines() if line.startswith("trillm:num_requests_running")
        ]
        if running and float(running[0].split()[-1]) == 0:
            break
        assert time.monotonic() < deadline, running
        time.sleep(0.05)


def test_api_key_is_required_except_for_health(tiny_model: Path) -> None:
    server = start_server(tiny_model, "--api-key", "secret")
    try:
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        r = httpx.get(f"{server.base_url}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"]
        ok = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200
    finally:
        server.stop()


# `make test` drains on SIGTERM in faults/test_http_shutdown.py (unsupervised: the short
# stream ends with length, exit 0, and more); this one, on the tiny model, is test-slow.
@pytest.mark.slow
def test_sigterm_drains_open_streams_then_exits_0(tiny_model: Path) -> None:
    server = start_server(tiny_model, "--shutdown-timeout", "20")
    lines: list[str] = []

    def stream() -> None:
        body = {"prompt": "drain", "max_tokens": 60, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            lines.extend(r.iter_lines())

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.5)
    server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert server.process.wait(timeout=60) == 0
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    assert data[-1]["choices"][0]["finish_reason"] == "length"


def test_engine_death_ends_streams_with_the_cause_and_turns_health_503(tiny_model: Path) -> None:
    server = start_server(tiny_model, "--keep-alive-on-engine-death")  # exiting: tests/faults
    try:
        (engine_pid,) = children(server.process.pid)
        lines: list[str] = []
        body = {"prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
            for i, line in enumerate(r.iter_lines()):
                lines.append(line)
                if i == 4:
                    os.kill(engine_pid, signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert "killed by signal 9 (SIGKILL)" in error["message"]
        assert httpx.get(f"{server.base_url}/health").status_code == 503
        r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 503 and "SIGKILL" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_overload_is_refused_at_once_and_stream_interval_groups_tokens(tiny_model: Path) -> None:
    server = start_server(tiny_model, "--max-queued-requests", "1", "--stream-interval", "4")
    try:
        # long enough to be running when the second request comes: the tiny model's C decode
        # step streams 30 tokens in a few ms, faster than a second request can be sent
        body = {"prompt": "x", "max_tokens": 480, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "y"})
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            chunks = [json.loads(x[6:]) for x in [*lines] if x.startswith("data: {")]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert len(texts) <= 480 // 4 + 2  # at least 4 tokens per chunk, but the last
        ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "y", "max_tokens": 2})
        assert ok.status_code == 200  # served once the first finished
    finally:
        server.stop()
