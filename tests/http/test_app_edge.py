"""The app's edge without a server: the key before routing (401, not 404 or 405), the header
block's size (431), the body's deadline (408, on trio's autojump clock), and which of them
close an HTTP/1 connection."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from trillm.http.edge._app import App
from trillm.http.edge._config import ServeConfig
from trillm.http.metrics._metrics import Metrics

KEY = "k-0123"


def app(**config: Any) -> App:
    return App(None, ServeConfig("tiny", api_key=KEY, **config), Metrics("tiny"))  # type: ignore[arg-type]


async def call(
    app: App,
    method: str,
    path: str,
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
    body: list[bytes] | None = None,
    http_version: str = "1.1",
) -> tuple[int, dict[bytes, bytes], dict[str, Any]]:
    """(status, headers, JSON body) of one request; `body` comes in those pieces, then the
    client sends nothing more (a body that never ends, unless its last piece is b"")."""
    pieces = list(body or [b""])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pieces:
            piece = pieces.pop(0)
            return {
                "type": "http.request",
                "body": piece,
                "more_body": bool(pieces) or piece != b"",
            }
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "http_version": http_version,
        "headers": headers or [],
    }
    await app(scope, receive, send)
    start, whole = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.lower(): v for k, v in start["headers"]}, json.loads(whole)


AUTH = [(b"authorization", f"Bearer {KEY}".encode())]


@pytest.mark.parametrize(
    ("method", "path", "with_key"),
    [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("PUT", "/metrics", 405)],
)
async def test_the_key_is_checked_before_routing(method: str, path: str, with_key: int) -> None:
    status, headers, body = await call(app(), method, path)
    assert (status, body["error"]["code"], headers[b"www-authenticate"]) == (
        401,
        "invalid_api_key",
        b"Bearer",
    )
    status, _, _ = await call(app(), method, path, headers=AUTH)
    assert status == with_key


@pytest.mark.parametrize("http_version", ["1.1", "2"])
async def test_a_header_block_over_the_limit_is_a_431(http_version: str) -> None:
    headers = [*AUTH, (b"x-big", b"a" * (16 << 10))]
    status, sent, body = await call(
        app(), "GET", "/health", headers=headers, http_version=http_version
    )
    assert status == 431 and body["error"]["code"] == "header_too_large"
    assert body["error"]["message"].endswith(
        "more than the limit of 16384; send fewer or shorter headers"
    )
    assert (sent.get(b"connection") == b"close") == (http_version == "1.1")  # HTTP/2 has none


async def test_a_body_that_does_not_arrive_in_time_is_a_408(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge = app(request_body_timeout=30.0)
    started = trio.current_time()
    status, sent, body = await call(edge, "POST", "/v1/completions", headers=AUTH, body=[b'{"pr'])
    assert trio.current_time() - started == pytest.approx(30.0)
    assert (status, sent[b"connection"], body["error"]["code"]) == (
        408,
        b"close",
        "request_timeout",
    )
    assert body["error"]["message"] == (
        "the request body did not arrive within 30 s (--request-body-timeout; 4 bytes came); "
        "send the whole body at once"
    )
