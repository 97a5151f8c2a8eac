"""Anthropic's Messages API through `trillm serve`, with the official anthropic SDK as oracle.

The model is the tiny random one, so its text is noise: these check shapes (what the SDK
parses), streams assembled by the SDK, forced tool calls (held by the grammar, validated
with `jsonschema`) and their round trip, stop sequences, token counts and error bodies.
Sampling fields the SDK has no arguments for (`temperature`) go as `extra_body`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from .conftest import Server, start_server

KEY = "sk-test"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: Any = {"name": "get_weather", "description": "The weather.", "input_schema": CITY}
FORCED: Any = {"type": "tool", "name": "get_weather"}
HELLO: Any = [{"role": "user", "content": "Hello"}]
GREEDY: Any = {"temperature": 0}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence"}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--api-key", KEY)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def test_a_plain_message_parses_with_its_usage(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="tiny", max_tokens=8, messages=HELLO, system="Be brief.")
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "tiny"
    assert message.stop_reason in STOP_REASONS and message.stop_sequence is None
    assert all(block.type == "text" for block in message.content)
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8


def test_a_stream_assembles_into_its_final_message(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="tiny", max_tokens=8, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in STOP_REASONS
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert final.usage.input_tokens > 0 and 0 < final.usage.output_tokens <= 8


def test_a_raw_stream_is_anthropics_event_sequence(client: anthropic.Anthropic) -> None:
    events = list(client.messages.create(model="tiny", max_tokens=6, messages=HELLO, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    opened = [e.index for e in events if e.type == "content_block_start"]
    closed = [e.index for e in events if e.type == "content_block_stop"]
    assert opened == closed == list(range(len(opened)))


def test_a_forced_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    question: Any = {"role": "user", "content": "Weather in Oslo?"}
    message = client.messages.create(
        model="tiny", max_tokens=64, messages=[question], tools=[WEATHER], tool_choice=FORCED
    )
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, CITY)
    result: Any = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "3 C, rain"}],
    }
    reply = client.messages.create(
        model="tiny",
        max_tokens=8,
        messages=[question, message.to_param(), result],
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    assert reply.stop_reason in STOP_REASONS
    assert all(block.type == "text" for block in reply.content)


def test_a_streamed_tool_use_assembles_its_input(client: anthropic.Anthropic) -> None:
    question: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    partial = []
    with client.messages.stream(
        model="tiny", max_tokens=64, messages=question, tools=[WEATHER], tool_choice=FORCED
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = final.content
    assert call.type == "tool_use" and call.input == json.loads("".join(partial))
    jsonschema.validate(call.input, CITY)


def test_a_tool_use_cut_by_max_tokens_has_the_input_it_reached(client: anthropic.Anthropic) -> None:
    """The whole message's `input` is the object its cut-off JSON reached: what the SDK's own
    accumulator makes of the same stream's input_json_delta events."""
    question: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    ask: Any = dict(model="tiny", messages=question, tools=[WEATHER], tool_choice=FORCED)
    full = client.messages.create(**ask, max_tokens=64, extra_body=GREEDY)
    cut_at = full.usage.output_tokens - 12  # inside the arguments, past the closing tag
    cut = client.messages.create(**ask, max_tokens=cut_at, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens"
    (call,) = cut.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input, dict) and call.input != full.content[0].input  # type: ignore[union-attr]
    with client.messages.stream(**ask, max_tokens=cut_at, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    (streamed,) = final.content
    assert streamed.type == "tool_use" and streamed.input == call.input


def test_a_stop_sequence_that_greedy_output_hits(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model="tiny", max_tokens=16, messages=HELLO, extra_body=GREEDY)
    text = "".join(b.text for b in first.content if b.type == "text")
    # two characters from the middle (a partly decoded character, U+FFFD, is no stop string)
    starts = [i for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2]]
    if not starts:
        pytest.skip(f"the greedy output {text!r} has no two whole characters past its middle")
    stop = text[starts[0] : starts[0] + 2]
    second = client.messages.create(
        model="tiny", max_tokens=16, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY
    )
    assert (second.stop_reason, second.stop_sequence) == ("stop_sequence", stop)
    cut = "".join(b.text for b in second.content if b.type == "text")
    assert cut == text[: text.index(stop)]  # up to where greedy output first wrote it


def test_count_tokens_counts_the_tools_too(client: anthropic.Anthropic) -> None:
    plain = client.messages.count_tokens(model="tiny", messages=HELLO)
    with_tools = client.messages.count_tokens(model="tiny", messages=HELLO, tools=[WEATHER])
    assert 0 < plain.input_tokens < with_tools.input_tokens


def test_a_wrong_key_is_an_authentication_error(server: Server) -> None:
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="tiny", max_tokens=4, messages=HELLO)
    assert isinstance(info.value.body, dict)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_another_model_is_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-x", max_tokens=4, messages=HELLO)
    assert isinstance(info.value.body, dict)
    assert info.value.body["error"]["type"] == "not_found_error"


def bad_request_body(info: pytest.ExceptionInfo[anthropic.BadRequestError]) -> str:
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    message: str = body["error"]["message"]
    return message


def test_an_image_block_is_a_bad_request_naming_it(client: anthropic.Anthropic) -> None:
    image: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=messages)
    assert "messages[0].content[1].type" in bad_request_body(info)


def test_a_server_tool_is_a_bad_request_naming_it(client: anthropic.Anthropic) -> None:
    search: Any = {"type": "web_search_20250305", "name": "web_search"}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=HELLO, tools=[search])
    assert "tools[0].type" in bad_request_body(info)


def test_a_missing_max_tokens_is_a_bad_request_naming_it(server: Server) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        json={"model": "tiny", "messages": HELLO},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens is required"},
    }
