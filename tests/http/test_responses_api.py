"""OpenAI's Responses API through `trillm serve`, with the official openai SDK as the oracle.

The model is the tiny random one, so its text is noise: these check shapes (what the SDK
parses), the event sequence, tool round trips and stored responses. Outputs held by a
grammar (a forced call, a json_schema format) are validated with `jsonschema`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from .conftest import Server, start_server

KEY = "sk-responses"
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
GET_TIME = {"type": "function", "name": "get_time", "parameters": ZONE}
TOOLS: Any = [GET_TIME]  # (the SDK's TypedDicts, as plain JSON)
ITEM = {
    "type": "object",
    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"}, "ok": {"type": "boolean"}},
    "required": ["sku", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--api-key", KEY, "--responses-store-size", "4")
    try:
        yield server
    finally:
        server.stop()


def sdk(server: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_a_plain_response_parses_with_its_usage(server: Server) -> None:
    response = sdk(server).responses.create(
        model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=6
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # 6 random tokens reach no end
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text != ""  # type: ignore[union-attr]
    usage = response.usage
    assert usage is not None and usage.output_tokens == 6 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + 6
    assert response.instructions == "Be brief." and response.max_output_tokens == 6


def test_a_stream_is_the_typed_event_sequence_numbered_from_zero(server: Server) -> None:
    events = list(
        sdk(server).responses.create(model="tiny", input="Hi", max_output_tokens=5, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response  # type: ignore[union-attr]
    assert "".join(deltas) == final.output_text and final.usage.output_tokens == 5


def test_a_function_call_round_trip_by_output_items_and_by_previous_response_id(
    server: Server,
) -> None:
    client = sdk(server)
    first = client.responses.create(
        model="tiny",
        input="What time is it?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_time"
    assert call.id is not None and call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), ZONE)
    answer: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    history: Any = [{"role": "user", "content": "What time is it?"}, call.model_dump(), answer]
    # The whole conversation sent back, as agent frameworks do without storage...
    again = client.responses.create(
        model="tiny", max_output_tokens=4, tools=TOOLS, tool_choice="none", input=history
    )
    assert again.output[0].type == "message"
    # ...and the stored one continued by id: the same prompt, so the same input length.
    continued = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[answer],
        max_output_tokens=4,
        tools=TOOLS,
        tool_choice="none",
    )
    assert continued.previous_response_id == first.id
    assert continued.usage is not None and again.usage is not None
    assert continued.usage.input_tokens == again.usage.input_tokens


def test_a_streamed_call_assembles_in_the_sdks_stream_helper(server: Server) -> None:
    named: Any = {"type": "function", "name": "get_time"}
    with sdk(server).responses.stream(
        model="tiny", input="Time?", tools=TOOLS, tool_choice=named, max_output_tokens=40
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), ZONE)
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds


def test_a_call_cut_by_the_token_limit_is_an_incomplete_item(server: Server) -> None:
    client = sdk(server)
    named: Any = {"type": "function", "name": "get_time"}
    ask: Any = dict(model="tiny", input="Time?", tools=TOOLS, tool_choice=named, temperature=0)
    full = client.responses.create(**ask, max_output_tokens=40)
    assert full.usage is not None and full.status == "completed"
    cut = client.responses.create(**ask, max_output_tokens=full.usage.output_tokens - 12)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    (call,) = cut.output
    assert call.type == "function_call" and call.status == "incomplete"
    (whole,) = full.output
    assert whole.type == "function_call" and whole.status == "completed"
    written = json.dumps(json.loads(whole.arguments), ensure_ascii=False)  # as generated
    assert written.startswith(call.arguments) and call.arguments != written


def test_a_json_schema_text_format_validates_streamed_and_not(server: Server) -> None:
    client = sdk(server)
    text: Any = {"format": {"type": "json_schema", "name": "item", "schema": ITEM, "strict": True}}
    whole = client.responses.create(
        model="tiny",
        input="An item.",
        text=text,
        max_output_tokens=60,
    )
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), ITEM)
    assert whole.text is not None and whole.text.format is not None
    assert whole.text.format.type == "json_schema"
    with client.responses.stream(
        model="tiny",
        input="An item.",
        text=text,
        max_output_tokens=60,
    ) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), ITEM)


def test_stored_responses_are_got_deleted_and_evicted(server: Server) -> None:
    client = sdk(server)
    kept = client.responses.create(model="tiny", input="a", max_output_tokens=2)
    assert kept.store is True
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    not_kept = client.responses.create(model="tiny", input="a", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_kept.id)
    with pytest.raises(openai.NotFoundError, match="is stored"):
        client.responses.create(model="tiny", input="b", previous_response_id=not_kept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    ids = [
        client.responses.create(model="tiny", input="c", max_output_tokens=1).id for _ in range(5)
    ]
    with pytest.raises(openai.NotFoundError):  # --responses-store-size 4: the oldest went
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True, "store": False}, "store"),  # a background response is stored
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs", "web_search_call.results"]},
         "include[1]"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),  # the server runs no reasoning parser
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    ],
)  # fmt: skip
def test_what_the_server_does_not_do_is_a_400_naming_the_field(
    server: Server, fields: dict[str, object], param: str
) -> None:
    body = {"model": "tiny", "input": "x", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server).responses.create(**body)  # type: ignore[call-overload]
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_the_api_key_is_asked_for_on_every_responses_route(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        sdk(server, key="wrong").responses.create(model="tiny", input="x")
    got = httpx.get(f"{server.base_url}/v1/responses/resp_x", timeout=10)
    assert got.status_code == 401
    got = httpx.get(
        f"{server.base_url}/v1/responses/resp_x", headers={"x-api-key": KEY}, timeout=10
    )
    assert got.status_code == 404 and got.json()["error"]["code"] == "not_found"


def test_a_reasoning_effort_is_chats_template_variable() -> None:
    from trillm.http.edge._errors import RequestError, fields_renamed
    from trillm.http.openai._requests import ChatMessage
    from trillm.http.responses._api import (
        RENAMES,
        ReasoningConfig,
        ResponsesRequest,
        chat_request,
    )

    hello = [ChatMessage("user", "Hi")]
    request = ResponsesRequest(input="Hi", reasoning=ReasoningConfig(effort="low"))
    assert chat_request(request, hello).reasoning_effort == "low"
    wrong = ResponsesRequest(input="Hi", reasoning=ReasoningConfig(effort="max"))
    refused = pytest.raises(RequestError, match=r"reasoning\.effort must be one of")
    with refused as info, fields_renamed(RENAMES):
        chat_request(wrong, hello)
    assert info.value.param == "reasoning.effort"
