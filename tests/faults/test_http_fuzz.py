"""Case 13: fuzzed request bodies never get a 500 or crash the server, and every refusal is an
OpenAI error object; an oversized body is refused before it is read, a header block over the
limit is refused.

The bodies are built by hypothesis from the request schemas' own field names (so most reach
the validation of each field, not just the JSON parser), with values that are right, wrong,
extreme or random JSON, plus bodies that are not JSON at all. Valid ones are served: the
null executor makes that fast.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.http.openai._requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

from ..http.conftest import Server
from .figures import record
from .http_harness import null_args, port_of, process_figures, serving, tiny_model_dir

ROUTES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
MAX_BODY = 4 << 20  # the server's default --max-body-bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tiny_model_dir(tmp_path_factory), *null_args(0.0)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 16, 128, 129, 512, 49151, 49152, 2**31, 2**63, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "text", "user", "assistant", "system", "\x00", "\ud7ff", "😀" * 8]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", ""])},
        optional={
            "content": st.one_of(
                st.text(max_size=60),
                st.none(),
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image_url", ""])},
                        optional={"text": st.one_of(st.text(max_size=20), json_values)},
                    ),
                    max_size=3,
                ),
                json_values,
            ),
            "name": st.one_of(st.text(max_size=10), json_values),
        },
    ),
    max_size=3,
)
# Plausible values for the fields whose shape matters most; any field may get random JSON.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        st.text(max_size=60),
        st.lists(st.integers(min_value=-5, max_value=50000), max_size=8),
        st.lists(st.text(max_size=10), max_size=3),
        st.lists(st.lists(st.integers(min_value=0, max_value=49151), max_size=4), max_size=3),
    ),
    "messages": messages,
    "tokens": st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=8),
    "max_tokens": st.integers(min_value=-2, max_value=600),
    "max_completion_tokens": st.integers(min_value=-2, max_value=600),
    "n": st.integers(min_value=-1, max_value=200),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}),
    "model": st.sampled_from(["tiny", "other", ""]),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5)),
    "logit_bias": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    "logprobs": st.one_of(st.booleans(), st.integers(min_value=-1, max_value=30)),
    "top_logprobs": st.integers(min_value=-1, max_value=30),
}


# Values that are right, for bodies that should be served (then one field may be spoiled).
VALID: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        st.text(min_size=1, max_size=40),
        st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=8),
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=40)}
        ),
        min_size=1,
        max_size=3,
    ),
    "tokens": st.lists(st.integers(min_value=0, max_value=49151), max_size=8),
    "max_tokens": st.integers(min_value=1, max_value=24),
    "n": st.integers(min_value=1, max_value=4),
    "stream": st.booleans(),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "seed": st.integers(min_value=0, max_value=2**31),
    "model": st.just("tiny"),
}


def fields_of(kind: type[msgspec.Struct]) -> list[str]:
    return [f.name for f in msgspec.structs.fields(kind)]


@st.composite
def bodies(draw: st.DrawFn, kind: type[msgspec.Struct]) -> bytes:
    shape = draw(st.sampled_from(["valid", "spoiled", "object", "json", "bytes", "truncated"]))
    if shape == "bytes":
        return draw(st.binary(max_size=200))
    if shape == "json":
        return json.dumps(draw(json_values)).encode()
    if shape in ("valid", "spoiled"):
        required = [f.name for f in msgspec.structs.fields(kind) if f.required]
        optional = [name for name in fields_of(kind) if name in VALID and name not in required]
        names = required + draw(st.lists(st.sampled_from(optional), unique=True, max_size=4))
        obj = {name: draw(VALID[name]) for name in names}
        if shape == "spoiled":
            obj[draw(st.sampled_from(fields_of(kind)))] = draw(json_values)
        return json.dumps(obj, allow_nan=True).encode()
    names = draw(st.lists(st.sampled_from(fields_of(kind)), unique=True, max_size=8))
    obj = {}
    for name in names:
        plausible = PLAUSIBLE.get(name)
        right = plausible is not None and draw(st.booleans())
        obj[name] = draw(plausible if right and plausible is not None else json_values)
    obj.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=2)))
    text = json.dumps(obj, allow_nan=True).encode()  # NaN and Infinity: not JSON
    if shape == "truncated":
        return text[: draw(st.integers(min_value=0, max_value=max(0, len(text) - 1)))]
    return text


def check(response: httpx.Response) -> None:
    """What every answer to a fuzzed body must be."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and {"param", "code"} <= set(error)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            data = json.loads(event)
            assert "error" not in data, data
    else:
        assert isinstance(response.json(), dict)


@pytest.mark.parametrize("route", list(ROUTES))
def test_fuzzed_bodies_get_an_answer_never_a_500(
    route: str, server: Server, client: httpx.Client
) -> None:
    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=bodies(ROUTES[route]))
    def fuzz(body: bytes) -> None:
        response = client.post(route, content=body, headers={"content-type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check(response)

    statuses: dict[int, int] = {}
    fuzz()
    assert server.process.poll() is None
    assert client.get("/health").status_code == 200
    seen = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
    record(13, f"fuzzed bodies on {route}, answers", sum(statuses.values()), f"({seen})")
    assert statuses.get(200, 0) > 0  # some were valid and served, not only refused


def raw_exchange(port: int, data: bytes, *, then_wait: float = 10) -> tuple[bytes, float]:
    """Send `data`, then read what the server answers until it closes or `then_wait` passes;
    (the answer, seconds to its first byte)."""
    with socket.create_connection(("127.0.0.1", port), timeout=then_wait) as sock:
        started = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # refused mid-send: what it said is still readable
        answer, first = b"", 0.0
        try:
            while chunk := sock.recv(65536):
                first = first or time.monotonic() - started
                answer += chunk
                if b"\r\n0\r\n\r\n" in answer or b"content-length: 0" in answer.lower():
                    break
        except (ConnectionResetError, TimeoutError):
            pass
        return answer, first


def test_an_oversized_body_is_refused_before_it_is_read(server: Server) -> None:
    port, pid = port_of(server), server.process.pid
    rss_before = process_figures(pid).rss_bytes
    # Declares 1 GiB, sends 1 KiB: the 413 must come without waiting for the rest.
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {1 << 30}\r\n\r\n"
    ).encode()
    answer, first = raw_exchange(port, head + b"{" + b" " * 1023)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert json.loads(answer[answer.index(b"{") :].split(b"\r\n")[0])["error"]["code"] == (
        "request_too_large"
    )
    # No Content-Length (chunked): refused as soon as the chunks pass the limit.
    chunk = b"x" * (1 << 20)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    answer_chunked, _ = raw_exchange(port, head + chunked)
    assert answer_chunked.startswith(b"HTTP/1.1 413"), answer_chunked[:200]
    growth = (process_figures(pid).rss_bytes - rss_before) / 2**20
    record(13, "413 for a body declared as 1 GiB, first byte after", first * 1e3, "ms")
    record(13, "server memory growth over the oversized bodies", growth, "MiB")
    assert first < 2.0
    assert growth < 2 * MAX_BODY / 2**20
    assert server.process.poll() is None


@pytest.mark.parametrize("shape", ["one long header", "many headers", "long request line"])
def test_a_header_block_over_the_limit_is_refused(server: Server, shape: str) -> None:
    if shape == "one long header":
        extra = b"X-Long: " + b"a" * (64 << 10) + b"\r\n"
        line = b"GET /health HTTP/1.1\r\n"
    elif shape == "many headers":
        extra = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 60) for i in range(1000))
        line = b"GET /health HTTP/1.1\r\n"
    else:
        extra, line = b"", b"GET /health?" + b"q" * (64 << 10) + b" HTTP/1.1\r\n"
    answer, _ = raw_exchange(port_of(server), line + b"Host: x\r\n" + extra + b"\r\n")
    # Refused: a 4xx status (hypercorn answers 431 or 400), never served as a request.
    assert answer.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), answer[:100]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    record(13, f"header block over 16 KiB ({shape}): status", int(answer[9:12]), "")
