"""Issue 25's red-team findings against a real `trillm serve` (null executor, API key set):
the HTTP edge never blocks, never answers bad input with a 500, and admits by work.

The cases that need a server of their own each are beside this file: crashes and the
supervisor (item 1, `test_redteam_crash.py`), the multi-node link (2,
`test_redteam_multinode.py`), the prefix cache's hashing and reporting (5,
`test_redteam_cache.py`); detokenising (6) and the sweep (7) are unit tests
(`tests/engine/client/test_detokenizer_bounded.py`,
`tests/transport_shm/test_sweep_safety.py`).

- 3: a 4 MiB prompt (to /tokenize, to /v1/completions) or a 120,000-message chat never
  delays another stream's tokens by more than 100 ms over that stream's worst gap before it.
- 4: prompts x n count against `--max-queued-requests`, /tokenize and /detokenize 1 each;
  one request never puts more than the queue into the engine; `--max-prompts-per-request`.
- 8: a body that trickles in gets a 408 at `--request-body-timeout`, its connection closed.
- 9: deep nesting, out-of-vocabulary ids and absurd sampling values are 400s naming the
  limit; a header block over 16 KiB is a 431 however it arrives (one write, HTTP/2);
  without the key every path is a 401; a key read from a file is not in `ps`; 300 generated
  bodies get no 500.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import openai
import pytest
import trio

from ..http.conftest import Server
from .http_harness import null_args, port_of, process_figures, scrape, serving, tiny_model_dir

KEY = "sk-redteam-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)
QUEUE = 8  # --max-queued-requests
PER_REQUEST = 12  # --max-prompts-per-request (above QUEUE, so both refusals can be seen)
BODY_TIMEOUT = 2.0  # --request-body-timeout
STEP = 0.005  # the null executor's step time: a token every 5 ms per stream
MAX_BODY = 4 << 20


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("redteam-key") / "api-key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[Server]:
    args = (
        "--api-key-file", str(key_file),
        "--max-queued-requests", str(QUEUE),
        "--max-prompts-per-request", str(PER_REQUEST),
        "--request-body-timeout", str(BODY_TIMEOUT),
        "--max-num-seqs", "16",
    )  # fmt: skip
    with serving(tiny_model_dir(tmp_path_factory), *null_args(STEP), *args) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of `response`, which must have `status`."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    error: dict[str, Any] = response.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys()
    return error


# -- 3: the loop never blocks ---------------------------------------------------------------

STREAM = {"prompt": "tick", "max_tokens": 400, "stream": True, "ignore_eos": True}
BASELINE_S = 1.0  # the other stream's gaps measured alone first, for this long
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven"]


def text_of(size: int) -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(size // 5))[:size]


@dataclass(frozen=True)
class Gaps:
    """The other stream's gaps between tokens: before the large request, and while it ran."""

    before: list[float]
    during: list[float]
    took: float


async def gaps_around(base_url: str, large: Callable[[], httpx.Response]) -> tuple[Gaps, Any]:
    """Streams run back to back (each gap counted, the one between streams too) while
    `large()` runs on a thread of this process after `BASELINE_S` seconds of them alone."""
    marks: list[tuple[float, float]] = []  # (the previous token's arrival, this one's)
    last: list[float] = []

    async def streams(client: httpx.AsyncClient) -> None:
        while True:
            async with client.stream("POST", "/v1/completions", json=STREAM) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last:
                            marks.append((last[0], now))
                        last[:] = [now]

    client = httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=120)
    async with client, trio.open_nursery() as nursery:
        nursery.start_soon(streams, client)
        await trio.sleep(BASELINE_S)  # a measuring window, not a wait for an event
        started = time.monotonic()
        answer = await trio.to_thread.run_sync(large)
        ended = time.monotonic()
        await trio.sleep(0.3)  # the gap a stall would leave ends at the next token
        nursery.cancel_scope.cancel()
    before = [b - a for a, b in marks if b < started and a > started - BASELINE_S + 0.2]
    during = [b - a for a, b in marks if b > started and a < ended]
    return Gaps(before, during, ended - started), answer


def post(base_url: str, path: str, body: bytes) -> Callable[[], httpx.Response]:
    def call() -> httpx.Response:
        headers = {**AUTH, "content-type": "application/json"}
        return httpx.post(base_url + path, content=body, headers=headers, timeout=120)

    return call


LARGE = {
    # 4 MiB of words: seconds of tokenising, on a tokenizer thread
    "tokenize a 4 MiB prompt": ("/tokenize", lambda: {"prompt": text_of(4_000_000)}, 200),
    # refused by the length of its head, after decoding
    "complete a 4 MiB prompt": (
        "/v1/completions",
        lambda: {"prompt": text_of(4_000_000), "max_tokens": 4},
        400,
    ),
    # 120,000 messages: refused (more than the model has positions) after decoding
    "chat with 120,000 messages": (
        "/v1/chat/completions",
        lambda: {"messages": [{"role": "user", "content": "x"}] * 120_000, "max_tokens": 4},
        400,
    ),
    # 500 messages of 1,000 characters: the template runs on a thread, then a 400 (too long)
    "chat with 500 long messages": (
        "/v1/chat/completions",
        lambda: {
            "messages": [{"role": "user", "content": text_of(1000)}] * 500,
            "max_tokens": 4,
        },
        400,
    ),
}


@pytest.mark.parametrize("case", list(LARGE))
async def test_a_large_request_never_delays_another_stream(server: Server, case: str) -> None:
    path, body_of, status = LARGE[case]
    body = json.dumps(body_of(), separators=(",", ":")).encode()
    assert len(body) <= MAX_BODY
    with trio.fail_after(90):
        gaps, response = await gaps_around(server.base_url, post(server.base_url, path, body))
    assert response.status_code == status, response.text[:300]
    assert gaps.before and gaps.during, gaps  # the stream ran before and during it
    worst_before, worst_during = max(gaps.before), max(gaps.during)
    print(f"{case}: took {gaps.took:.2f} s, worst gap {worst_during * 1e3:.0f} ms during, "
          f"{worst_before * 1e3:.0f} ms before")  # fmt: skip
    assert worst_during < 0.100 + worst_before, (case, worst_during, worst_before, gaps.took)


# -- 4: admission by work -------------------------------------------------------------------


def test_one_request_of_many_prompts_is_refused_at_once_naming_the_cap(
    server: Server, client: httpx.Client
) -> None:
    rss_before = process_figures(server.process.pid).rss_bytes
    started = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": ["p"] * 20_000, "n": 4, "max_tokens": 2})
    took = time.monotonic() - started
    error = error_of(r, 400)
    assert error["message"] == (
        "this request asks for 20000 prompts x n 4 = 80000 completions, more than "
        f"--max-prompts-per-request ({PER_REQUEST}); split it into smaller requests"
    )
    assert error["param"] == "prompt"
    growth = (process_figures(server.process.pid).rss_bytes - rss_before) / 2**20
    assert took < 5 and growth < 64, (took, growth)  # it was 197 MiB and time-outs
    # Within the cap but more than the whole queue: can never be admitted, so a 400 too.
    r = client.post("/v1/completions", json={"prompt": ["p"] * 5, "n": 2, "max_tokens": 2})
    assert (
        "more than the whole queue holds (--max-queued-requests 8)" in error_of(r, 400)["message"]
    )
    assert scrape(server, client)["trillm:num_requests_waiting"] == 0


async def test_prompts_times_n_count_against_the_queue(server: Server) -> None:
    """3 prompts x n 2 hold 6 of 8: 2 more fit, 3 do not (429); with the queue full even
    /tokenize and /detokenize are refused; the engine never holds more than the queue."""
    body = {**STREAM, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 300}
    seen: list[float] = []
    async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:

        async def hold(request: dict[str, Any], started: trio.Event) -> None:
            async with client.stream("POST", "/v1/completions", json=request) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                six, two = trio.Event(), trio.Event()
                nursery.start_soon(hold, body, six)
                await six.wait()
                three = {"prompt": ["x", "y", "z"], "max_tokens": 2}
                r = await client.post("/v1/completions", json=three)
                assert error_of(r, 429)["code"] == "overloaded"
                assert r.headers["retry-after"] == "1"
                nursery.start_soon(hold, {**STREAM, "prompt": ["d", "e"], "max_tokens": 300}, two)
                await two.wait()  # 6 + 2: the queue is full
                for path, request in (
                    ("/tokenize", {"prompt": "hi"}),
                    ("/detokenize", {"tokens": [1]}),
                ):
                    r = await client.post(path, json=request)
                    assert error_of(r, 429)["code"] == "overloaded", path
                metrics = await client.get("/metrics")
                for line in metrics.text.splitlines():
                    if line.startswith(
                        ("trillm:num_requests_running", "trillm:num_requests_waiting")
                    ):
                        seen.append(float(line.rsplit(" ", 1)[1]))
                nursery.cancel_scope.cancel()
    assert sum(seen) == QUEUE  # 8 sequences in the engine: the queue, and no more


# -- 8: slow bodies -------------------------------------------------------------------------


async def test_a_trickling_body_gets_408_and_its_connection_closed(server: Server) -> None:
    """20 connections send a byte every 0.5 s of a 1,000-byte body: each gets a 408 at the
    deadline and is closed; a head that trickles is closed too (hypercorn's keep-alive
    timeout, 5 s, runs until the head is whole); a body that arrives in time is served."""
    port = port_of(server)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    answers: list[tuple[bytes, float]] = []

    async def trickle() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            started = time.monotonic()
            await stream.send_all(head)
            answer = b""

            async def send_slowly() -> None:
                with trio.move_on_after(30), contextlib.suppress(trio.BrokenResourceError):
                    while True:
                        await stream.send_all(b" ")
                        await trio.sleep(0.5)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_slowly)
                with contextlib.suppress(trio.BrokenResourceError):
                    while chunk := await stream.receive_some(65536):  # until the server closes
                        answer += chunk
                nursery.cancel_scope.cancel()
            answers.append((answer, time.monotonic() - started))

    head_closed: list[tuple[bytes, float]] = []

    async def trickle_head() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            started = time.monotonic()
            await stream.send_all(b"GET /health HTTP/1.1\r\n")

            async def send_slowly() -> None:
                with trio.move_on_after(30), contextlib.suppress(trio.BrokenResourceError):
                    for i in range(1000):
                        await stream.send_all(b"X-%d: y\r\n" % i)
                        await trio.sleep(0.5)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_slowly)
                answer = b""
                with contextlib.suppress(trio.BrokenResourceError):
                    while chunk := await stream.receive_some(65536):
                        answer += chunk
                nursery.cancel_scope.cancel()
            head_closed.append((answer, time.monotonic() - started))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle_head)
            for _ in range(20):
                nursery.start_soon(trickle)
    assert len(answers) == 20
    [(answer, took)] = head_closed
    assert not answer.startswith(b"HTTP/1.1 200") and 4 < took < 12, (answer[:100], took)
    for answer, took in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"connection: close" in answer.lower()
        assert b"--request-body-timeout" in answer
        assert BODY_TIMEOUT - 0.2 < took < BODY_TIMEOUT + 5, took
    # A body sent in pieces within the deadline is served.
    body = json.dumps({"prompt": "in time", "max_tokens": 2}).encode()
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(head.replace(b"1000", str(len(body)).encode()))
            for i in range(0, len(body), 8):
                await stream.send_all(body[i : i + 8])
                await trio.sleep(0.05)
            answer = await stream.receive_some(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# -- 9: no 500 for bad input ----------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = {
    "an unknown field": ("/v1/completions", f'{{"prompt":"a","extra":{nested(3000)}}}'),
    "structured_outputs.json": (
        "/v1/completions",
        f'{{"prompt":"a","structured_outputs":{{"json":{{"a":{nested(3000)}}}}}}}',
    ),
    "a schema in response_format": (
        "/v1/chat/completions",
        '{"max_tokens":2,"messages":[{"role":"user","content":"hi"}],"response_format":'
        '{"type":"json_schema","json_schema":{"name":"x","schema":{"a":' + nested(300) + "}}}}",
    ),
    "tool_calls[].arguments as an object": (
        "/v1/chat/completions",
        '{"max_tokens":2,"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":'
        '"1","type":"function","function":{"name":"f","arguments":{"a":' + nested(300) + "}}}]},"
        '{"role":"user","content":"hi"}]}',
    ),
    "tool_calls[].arguments as text": (
        "/v1/chat/completions",
        json.dumps(
            {
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": nested(3000)},
                            }
                        ],
                    },
                    {"role": "user", "content": "hi"},
                ],
            }
        ),
    ),
    "structured_outputs.json as text": (
        "/v1/completions",
        json.dumps({"prompt": "a", "structured_outputs": {"json": '{"a":' + nested(3000) + "}"}}),
    ),
    "the /tokenize messages": (
        "/tokenize",
        '{"messages":[{"role":"user","content":"hi","extra":' + nested(3000) + "}]}",
    ),
}


@pytest.mark.parametrize("case", list(DEEP))
def test_deep_nesting_is_a_400(client: httpx.Client, case: str) -> None:
    path, body = DEEP[case]
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    message = error_of(r, 400)["message"]
    assert "deep" in message, message


def test_nesting_within_the_limit_is_served(client: httpx.Client) -> None:
    body = f'{{"prompt":"a","max_tokens":2,"extra":{{"a":{nested(200)}}}}}'
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]


OOV = [
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [1, VOCAB]}, "stop_token_ids", VOCAB),
    (
        "/v1/completions",
        {"prompt": "a", "logit_bias": {str(VOCAB + 7): 1}},
        "logit_bias",
        VOCAB + 7,
    ),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2**63 - 1]}, "stop_token_ids", 2**63 - 1),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(2**40): -5}}, "logit_bias", 2**40),
    ("/v1/completions", {"prompt": [1, 2, VOCAB]}, "prompt", VOCAB),
    ("/detokenize", {"tokens": [1, VOCAB + 1]}, "tokens", VOCAB + 1),
]


@pytest.mark.parametrize(("path", "body", "param", "value"), OOV)
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_vocabulary_ids_are_a_400_naming_them(
    client: httpx.Client, path: str, body: dict[str, Any], param: str, value: int, stream: bool
) -> None:
    if stream and path == "/detokenize":
        return
    r = client.post(path, json={**body, "stream": True} if stream else body)
    error = error_of(r, 400)  # before any stream starts
    assert error["param"] == param and str(value) in error["message"], error
    assert str(VOCAB) in error["message"], error


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"temperature": 3.5e38}, "temperature", "temperature must be <= 100, got 3.5e+38"),
        ({"top_p": 1e300}, "top_p", "top_p must be in (0, 1], got 1e+300"),
        ({"presence_penalty": 1e308}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        (
            {"repetition_penalty": 1e-300},
            "repetition_penalty",
            "repetition_penalty must be in [0.001, 1000], got 1e-300",
        ),
        ({"logit_bias": {"5": 1e308}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
        (
            {"logit_bias": {str(i): 1 for i in range(2000)}},
            "logit_bias",
            "the number of logit_bias entries must be <= 1024, got 2000",
        ),
        ({"stop_token_ids": [3] * 5000}, "stop_token_ids", "the number of stop_token_ids must"),
    ],
)
def test_absurd_sampling_values_are_a_400(
    server: Server, extra: dict[str, Any], param: str, words: str
) -> None:
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            response_format={"type": "json_object"},
            extra_body=extra,
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"]


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999"])
def test_non_finite_numbers_are_a_400(client: httpx.Client, literal: bytes) -> None:
    body = b'{"prompt": "a", "temperature": ' + literal + b"}"
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    error_of(r, 400)


def raw_answer(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send `data` in one write; what the server answers until it closes (or a response
    ends, or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if answer.endswith(b"\r\n0\r\n\r\n"):
                    break
        except (ConnectionResetError, TimeoutError):
            pass
        return answer


@pytest.mark.parametrize("size", [17 << 10, 40 << 10, 60 << 10])
def test_a_header_block_over_16_kib_in_one_write_is_a_431(server: Server, size: int) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + f"Authorization: Bearer {KEY}\r\n".encode()
    answer = raw_answer(port_of(server), head + b"X-Big: " + b"a" * size + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"connection: close" in answer.lower()
    # Just under the limit: served.
    answer = raw_answer(port_of(server), head + b"X-Big: " + b"a" * (15 << 10) + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def h2_status(port: int, headers: list[tuple[str, str]], *, upgrade: bool) -> int | None:
    """The status HTTP/2 answers to one GET with `headers` (None: the connection was closed
    without one), over h2c with prior knowledge or through an HTTP/1.1 Upgrade."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if upgrade:
            settings = connection.initiate_upgrade_connection()
            extra = "".join(f"{k}: {v}\r\n" for k, v in headers if not k.startswith(":"))
            sock.sendall(
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n" + extra.encode() + b"\r\n"
            )
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                head += chunk
            if not head.startswith(b"HTTP/1.1 101"):
                return int(head[9:12])
            rest = head.split(b"\r\n\r\n", 1)[1]
            sock.sendall(connection.data_to_send())
            events = connection.receive_data(rest) if rest else []
        else:
            connection.initiate_connection()
            connection.send_headers(1, headers, end_stream=True)
            sock.sendall(connection.data_to_send())
            events = []
        try:
            while True:
                for event in events:
                    if isinstance(event, h2.events.ResponseReceived):
                        return int(dict(event.headers)[b":status"])
                    if isinstance(event, (h2.events.ConnectionTerminated, h2.events.StreamReset)):
                        return None
                sock.sendall(connection.data_to_send())
                data = sock.recv(65536)
                if not data:
                    return None
                events = connection.receive_data(data)
        except (ConnectionResetError, TimeoutError):
            return None


@pytest.mark.parametrize("upgrade", [False, True], ids=["prior knowledge", "upgrade"])
def test_a_header_block_over_16_kib_over_http2_is_refused(server: Server, upgrade: bool) -> None:
    base = [(":method", "GET"), (":path", "/v1/models"), (":scheme", "http"), (":authority", "x")]
    base.append(("authorization", f"Bearer {KEY}"))
    port = port_of(server)
    assert h2_status(port, base, upgrade=upgrade) == 200
    for size in (20 << 10, 40 << 10):  # under h2's own 64 KiB: the app's 431, on the stream
        assert h2_status(port, [*base, ("x-big", "a" * size)], upgrade=upgrade) == 431
    status = h2_status(port, [*base, ("x-big", "a" * (70 << 10))], upgrade=upgrade)
    assert status in (431, None), status  # over it: a 431, or the connection closed
    assert httpx.get(f"{server.base_url}/health").status_code == 200


UNKNOWN = [
    ("GET", "/v1/nothing"),
    ("GET", "/admin"),
    ("GET", "/v1/completions"),  # a 405 with the key
    ("DELETE", "/v1/models"),
    ("POST", "/metrics"),
    ("GET", "/tokenize"),
    ("GET", "/docs"),
    ("GET", "/v1/models/nothing"),
]


def test_without_the_key_every_path_is_a_401(server: Server, client: httpx.Client) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        for method, path in UNKNOWN:
            r = anonymous.request(method, path)
            assert error_of(r, 401)["code"] == "invalid_api_key", (method, path)
        assert anonymous.get("/health").status_code == 200  # open, as documented
        assert anonymous.post("/health").status_code == 405
    statuses = {client.request(method, path).status_code for method, path in UNKNOWN}
    assert statuses == {404, 405}


def test_the_key_from_a_file_is_not_on_the_command_line(
    server: Server, client: httpx.Client, key_file: Path
) -> None:
    command_line = " ".join(map(str, server.process.args))  # what `ps` showed at its start
    assert KEY not in command_line and f"--api-key-file {key_file}" in command_line
    with open(f"/proc/{server.process.pid}/cmdline", "rb") as f:  # (renamed trillm::api since)
        assert KEY.encode() not in f.read()
    assert client.get("/v1/models").status_code == 200
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        assert anonymous.get("/v1/models").status_code == 401


# -- 9: a fuzz of hostile bodies ------------------------------------------------------------

HUGE_NUMBERS = [
    "1e308",
    "-1e308",
    "1e400",
    "NaN",
    "Infinity",
    "-Infinity",
    str(2**64),
    str(-(2**63) - 1),
]
FIELDS = [
    "temperature", "top_p", "top_k", "min_p", "n", "max_tokens", "min_tokens", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
    "stop", "stop_token_ids", "logit_bias", "prompt", "messages", "tokens", "structured_outputs",
    "response_format", "tools", "tool_choice", "add_special_tokens", "stream", "echo",
]  # fmt: skip


def hostile_value(rng: random.Random) -> str:
    """A JSON value (as text, which may be no JSON at all) meant to break something."""
    kind = rng.randrange(9)
    if kind == 0:
        depth = rng.choice([100, 255, 257, 1000, 5000])
        return nested(depth) if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
    if kind == 1:
        return rng.choice(HUGE_NUMBERS)
    if kind == 2:
        return json.dumps([rng.choice([VOCAB, VOCAB + 1, 2**40, -1, 2**63 - 1]) for _ in range(3)])
    if kind == 3:
        return json.dumps({str(rng.choice([VOCAB, 2**33, -3, 5])): rng.choice([1, 1e300, -500])})
    if kind == 4:
        return json.dumps([rng.randrange(VOCAB)] * rng.choice([2000, 20000]))
    if kind == 5:
        return json.dumps(["p"] * rng.choice([13, 500, 5000]))
    if kind == 6:
        return rng.choice(['"text"', "true", "null", "{}", "[]", '{"type": 5}', '"\\ud800"'])
    if kind == 7:
        return json.dumps("x" * rng.choice([10, 5000, 100_000]))
    return json.dumps(
        [{"role": "user", "content": rng.choice(["hi", 5, None, [{"type": "text"}]])}]
    )


def hostile_body(rng: random.Random, path: str) -> bytes:
    base: dict[str, str] = (
        {"prompt": '"a"', "max_tokens": "2"}
        if path == "/v1/completions"
        else {"prompt": '"a"'}
        if path == "/tokenize"
        else {"messages": '[{"role": "user", "content": "hi"}]', "max_tokens": "2"}
    )
    for name in rng.sample(FIELDS, rng.randrange(1, 4)):
        base[name] = hostile_value(rng)
    text = "{" + ",".join(f'"{k}":{v}' for k, v in base.items()) + "}"
    if rng.random() < 0.05:
        text = text[: rng.randrange(len(text))]  # cut short
    return text.encode()


def test_300_hostile_bodies_get_no_500(server: Server, client: httpx.Client) -> None:
    rng = random.Random(25)
    statuses: dict[int, int] = {}
    started = time.monotonic()
    for i in range(300):
        path = ["/v1/chat/completions", "/v1/completions", "/tokenize"][i % 3]
        body = hostile_body(rng, path)
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body[:300], r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text
    assert client.get("/health").status_code == 200 and server.process.poll() is None
    print(f"300 hostile bodies in {time.monotonic() - started:.1f} s: {sorted(statuses.items())}")
    assert statuses.get(400, 0) > 100
