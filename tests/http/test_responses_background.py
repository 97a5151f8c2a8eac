"""The Responses API's `background: true` and cancel (OpenAI's; vLLM's
tests/v1/entrypoints/openai/responses/test_stateful.py test_background and
test_background_cancel), and output text logprobs (`top_logprobs`, `include:
["message.output_text.logprobs"]`), through the openai SDK.

Background runs go on the null executor (the host side for real, each step 20 ms), so a run
of 400 tokens is still going when it is cancelled; the logprobs come from the tiny model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from trillm.http.edge._config import ServeConfig

from .conftest import Server, start_server
from .test_tokenize_api import app_client


@pytest.fixture(scope="module")
def slow(tiny_model: Path) -> Iterator[Server]:
    server = start_server(
        tiny_model, "--executor", "null", "--null-step-time", "0.02",
        "--responses-store-size", "4", "--max-queued-requests", "1",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def wait_for(
    client: openai.OpenAI, response_id: str, status: str
) -> openai.types.responses.Response:
    deadline = time.monotonic() + 60
    while True:
        response = client.responses.retrieve(response_id)
        if response.status == status or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_is_polled_to_its_end(slow: Server) -> None:
    client = sdk(slow)
    created = client.responses.create(
        model="tiny", input="Hello", background=True, max_output_tokens=5
    )
    assert created.background is True and created.status in ("queued", "in_progress")
    assert created.output == [] and created.usage is None
    done = wait_for(client, created.id, "incomplete")  # max_output_tokens cut it
    assert done.status == "incomplete" and done.background is True
    assert done.usage is not None and done.usage.output_tokens == 5
    assert done.output[0].type == "message"
    # the run freed its place in the queue (--max-queued-requests 1)
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert r.status == "incomplete"


def test_a_running_background_response_is_cancelled(slow: Server) -> None:
    client = sdk(slow)
    created = client.responses.create(
        model="tiny", input="Hello", background=True, max_output_tokens=400
    )
    # it holds the request's place in the queue while it runs
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    assert client.responses.retrieve(created.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="is cancelled: only a background"):
        client.responses.cancel(created.id)
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert r.status == "incomplete"  # the place was freed
    with pytest.raises(openai.BadRequestError, match="is incomplete: only a background"):
        client.responses.cancel(r.id)  # vLLM: "Cannot cancel a synchronous response."
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nothing")


def test_background_needs_store_and_no_stream(slow: Server) -> None:
    url = f"{slow.base_url}/v1/responses"
    for extra, param in (({"store": False}, "store"), ({"stream": True}, "stream")):
        body = {"model": "tiny", "input": "Hi", "background": True, **extra}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    body = {"model": "tiny", "input": "Hi", "include": ["file_search_call.results"]}
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include[0]", r.text
    assert "'file_search_call.results' is not supported" in r.json()["error"]["message"]


async def test_output_text_carries_logprobs(tiny_model: Path) -> None:
    """OpenAI's `top_logprobs` / include "message.output_text.logprobs": the output_text
    part's `logprobs`, each token with its top alternatives; none unless asked."""
    async with app_client(tiny_model, ServeConfig("tiny")) as client:
        base = {"model": "tiny", "input": "Hello", "max_output_tokens": 6}
        plain = (await client.post("/v1/responses", json=base)).json()
        assert plain["output"][0]["content"][0]["logprobs"] == []
        for asked in ({"top_logprobs": 2}, {"include": ["message.output_text.logprobs"]}):
            r = await client.post("/v1/responses", json={**base, **asked})
            assert r.status_code == 200, r.text
            part = r.json()["output"][0]["content"][0]
            logprobs = part["logprobs"]
            assert 5 <= len(logprobs) <= 6  # the text's tokens (an end token shows no text)
            assert all(lp["logprob"] <= 0 and lp["bytes"] for lp in logprobs)
            tops = {len(lp["top_logprobs"]) for lp in logprobs}
            assert tops == {asked.get("top_logprobs", 0)}
            assert "".join(lp["token"] for lp in logprobs).strip() in part["text"] + " "
