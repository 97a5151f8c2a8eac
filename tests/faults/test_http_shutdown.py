"""Case 10: SIGTERM with open streams, then a second signal.

First signal: new requests are refused (a new connection is not accepted; a request on a
connection already open gets 503), in-flight requests drain up to `--shutdown-timeout`, the
rest end with a shutdown error event and `[DONE]`, and the server exits 0. A second signal
ends everything at once. Both with the API server in the `trillm serve` process and under its
supervisor (`--max-api-restarts`), where the signals reach the parent and are forwarded.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
import trio

from .figures import record
from .http_harness import null_args, open_sse, port_of, serving, tiny_model_dir

SHUTDOWN_TIMEOUT = 2.0
SUPERVISION = [
    pytest.param((), id="unsupervised"),
    pytest.param(("--max-api-restarts", "3"), id="supervised", marks=pytest.mark.slow),
]


def stream_body(max_tokens: int) -> bytes:
    return json.dumps(
        {"prompt": "drain me", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()


@pytest.mark.parametrize("supervision", SUPERVISION)
def test_sigterm_refuses_new_requests_drains_the_short_ends_the_long(
    tmp_path_factory: pytest.TempPathFactory, supervision: tuple[str, ...]
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    timeout = str(SHUTDOWN_TIMEOUT)
    args = (*null_args(0.01), "--shutdown-timeout", timeout, *supervision)
    with serving(model, *args) as server:
        port = port_of(server)

        async def scenario() -> dict[str, float]:
            short = await open_sse(port, "/v1/completions", stream_body(60))  # 0.6 s
            long = await open_sse(port, "/v1/completions", stream_body(480))  # 4.8 s
            for reader in (short, long):
                assert await reader.read_status() == 200
                assert await reader.next_event() is not None
            async with httpx.AsyncClient() as keep_alive:  # a connection open before
                assert (await keep_alive.get(f"{server.base_url}/v1/models")).status_code == 200
                signalled = time.monotonic()
                server.process.send_signal(signal.SIGTERM)
                await trio.sleep(0.2)
                # Refused: the idle connection was closed and a new one is not accepted, or
                # (had the request come first on the open connection) a 503; never served.
                try:
                    late = await keep_alive.post(
                        f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}
                    )
                except httpx.ConnectError:
                    pass
                else:
                    assert late.status_code == 503, late.text
                    assert late.json()["error"]["message"] == "the server is shutting down"
                    assert int(late.headers["retry-after"]) >= 1
            with pytest.raises(httpx.ConnectError):
                async with httpx.AsyncClient() as fresh:
                    await fresh.get(f"{server.base_url}/health")
            short_events = await short.events()
            short_done = time.monotonic() - signalled
            long_events = await long.events()
            long_done = time.monotonic() - signalled
            code = await trio.to_thread.run_sync(server.process.wait, 30)
            exited = time.monotonic() - signalled
            assert code == 0
            assert short_events[-1] == b"[DONE]"
            assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
            assert long_events[-1] == b"[DONE]"
            error = json.loads(long_events[-2])["error"]
            assert error["message"] == "the server is shutting down" and error["type"]
            return {"short": short_done, "long": long_done, "exit": exited}

        times = trio.run(scenario)
    record(10, "short stream finished after SIGTERM", times["short"], "s")
    record(
        10,
        f"long stream ended with a shutdown error (--shutdown-timeout {timeout})",
        times["long"],
        "s",
    )
    record(10, "SIGTERM to exit 0", times["exit"], "s")
    assert times["short"] < SHUTDOWN_TIMEOUT
    assert SHUTDOWN_TIMEOUT - 0.5 < times["long"] < SHUTDOWN_TIMEOUT + 2
    assert times["exit"] < SHUTDOWN_TIMEOUT + 10  # the engine drained, not its 30 s timeout


@pytest.mark.parametrize("supervision", SUPERVISION)
def test_a_second_sigint_aborts_at_once(
    tmp_path_factory: pytest.TempPathFactory, supervision: tuple[str, ...]
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    with serving(model, *null_args(0.01), "--shutdown-timeout", "60", *supervision) as server:
        port = port_of(server)

        async def scenario() -> float:
            long = await open_sse(port, "/v1/completions", stream_body(480))
            assert await long.read_status() == 200
            assert await long.next_event() is not None
            server.process.send_signal(signal.SIGTERM)
            await trio.sleep(0.5)
            assert server.process.poll() is None  # draining: 60 s allowed
            started = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            await trio.to_thread.run_sync(server.process.wait, 30)
            took = time.monotonic() - started
            events = await long.events()  # the connection was closed, mid-stream
            assert b"[DONE]" not in events
            return took

        took = trio.run(scenario)
    record(10, "second SIGINT to exit, with a stream open", took, "s")
    assert took < 20  # at once: not the 60 s of draining the first signal allowed
