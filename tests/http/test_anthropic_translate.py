"""The Messages API's translation onto a chat request, and its face fed a real turn.

The oracle for the wire shape is the anthropic SDK: every event the face writes must validate
as a `RawMessageStreamEvent`, the events must assemble (with the SDK's own accumulator) into
the message the whole body is, and that body must validate as a `Message`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import msgspec.structs
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent

from trillm.engine.client import Output
from trillm.http.anthropic._api import (
    CountTokensRequest,
    MessagesFace,
    MessagesRequest,
    anthropic_error_body,
    chat_request,
    count_tokens_response,
)
from trillm.http.anthropic._checks import check_thinking
from trillm.http.edge._errors import RequestError
from trillm.http.openai._requests import ChatCompletionRequest
from trillm.http.openai._schemas import decode_request
from trillm.http.turn._chat_output import ChatOutputParser
from trillm.http.turn._constraints import NamedToolChoice
from trillm.http.turn._turn import TurnBlocks

EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
PIECES = ["<think>", "let me", " see</think>", "\n\nIt is ", "cold.", "\n" + CALL[:20], CALL[20:]]


def translate(kind: type[Any] = MessagesRequest, **body: Any) -> ChatCompletionRequest:
    """`body` (with a model, max_tokens and one user message unless given) as chat."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    if kind is MessagesRequest:
        body.setdefault("max_tokens", 16)
    return chat_request(decode_request(msgspec.json.encode(body), kind))


def refused(param: str, **body: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        translate(**body)
    assert info.value.status == 400 and info.value.param == param
    assert param in info.value.message
    return info.value


# -- the request ----------------------------------------------------------------------------


def test_the_sampling_fields_map_onto_chat() -> None:
    chat = translate(
        max_tokens=7,
        stop_sequences=["END"],
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        metadata={"user_id": "u-1"},
        system="Be brief.",
    )
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (
        7,
        ["END"],
        0.5,
        0.9,
        40,
    )
    assert chat.user == "u-1" and chat.tools is None and chat.tool_choice is None
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "hi")]


def test_system_blocks_and_system_messages_are_system_messages() -> None:
    chat = translate(
        system=[
            {"type": "text", "text": "A"},
            {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "system", "content": "C"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    )
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "A\nB"),
        ("system", "C"),
        ("user", "hi"),
    ]


def test_an_assistant_turn_has_its_text_calls_and_thinking() -> None:
    chat = translate(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "they want ", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "thinking", "thinking": "Oslo", "signature": "s"},
                    {"type": "text", "text": "Looking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}},
                ],
            },
            {"role": "user", "content": "and?"},
        ],
    )
    reply = chat.messages[1]
    assert (reply.role, reply.content, reply.reasoning_content) == (
        "assistant",
        "Looking.",
        "they want Oslo",
    )
    assert reply.tool_calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in reply.tool_calls] == [
        ("toolu_1", "get_weather", json.dumps({"city": "Oslo"})),
        ("toolu_2", "get_weather", "{}"),
    ]


def test_an_assistant_turn_of_calls_only_has_no_content() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    chat = translate(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        ]
    )
    assert chat.messages[1].content is None and chat.messages[1].tool_calls


def test_tool_results_become_tool_messages_in_order_then_the_text() -> None:
    chat = translate(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "here:"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "no such"},
                            {"type": "text", "text": "city"},
                        ],
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_3"},
                    {"type": "text", "text": "thanks"},
                ],
            }
        ]
    )
    assert [(m.role, m.tool_call_id, m.content) for m in chat.messages] == [
        ("tool", "toolu_1", "3 C"),
        ("tool", "toolu_2", "Error: no such\ncity"),
        ("tool", "toolu_3", ""),
        ("user", None, "here:\nthanks"),
    ]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "image", "source": {}}]}, "messages[0].content[0]"),
        (
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "document"}]},
            "messages[0].content[1]",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            "messages[0].content[0]",
        ),
        (
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            "messages[0].content[0]",
        ),
        ({"role": "assistant", "content": [{"type": "server_tool_use"}]}, "messages[0].content[0]"),
        (
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}
                ],
            },
            "messages[0].content[0].content[0]",
        ),
    ],
)
def test_a_block_of_another_type_is_refused_by_its_place(message: Any, param: str) -> None:
    user = {"role": "user", "content": "next"}
    err = refused(f"{param}.type", messages=[message, user])
    assert "send" in err.message  # and it says what to send


@pytest.mark.parametrize(
    ("block", "param"),
    [
        ({"type": "text"}, "text"),
        ({"type": "text", "text": "a", "citations": [{"type": "char_location"}]}, "citations"),
        ({"type": "tool_result"}, "tool_use_id"),
    ],
)
def test_a_user_block_missing_a_field_is_refused_naming_it(block: Any, param: str) -> None:
    refused(f"messages[0].content[0].{param}", messages=[{"role": "user", "content": [block]}])


@pytest.mark.parametrize("missing", ["id", "name", "input"])
def test_a_tool_use_block_needs_its_id_name_and_input(missing: str) -> None:
    call = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    del call[missing]
    user = {"role": "user", "content": "x"}
    messages = [user, {"role": "assistant", "content": [call]}, user]
    refused(f"messages[1].content[0].{missing}", messages=messages)


def test_a_prefill_and_an_unknown_role_are_refused() -> None:
    prefill = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answ"}]
    err = refused("messages[1].role", messages=prefill)
    assert "end the conversation with a user message" in err.message
    refused("messages[0].role", messages=[{"role": "tool", "content": "x"}])


def test_tools_are_functions_and_tool_choice_maps_onto_chat() -> None:
    tool = {
        "name": "get_weather",
        "description": "The weather.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
        "cache_control": {"type": "ephemeral"},
        "input_examples": [{"city": "Oslo"}],
        "type": "custom",
    }
    chat = translate(tools=[tool])
    assert chat.tools is not None
    (function,) = [t.function for t in chat.tools]
    assert function.name == "get_weather" and function.strict is True
    assert function.parameters == tool["input_schema"]
    assert function.description == 'The weather.\n\nExample inputs:\n{"city": "Oslo"}'
    assert (chat.tool_choice, chat.parallel_tool_calls) == (None, True)  # chat's auto


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        ({"type": "auto", "disable_parallel_tool_use": False}, "auto", True),
    ],
)
def test_tool_choice_types(choice: Any, chat_choice: str, parallel: bool) -> None:
    chat = translate(tools=[WEATHER], tool_choice=choice)
    assert (chat.tool_choice, chat.parallel_tool_calls) == (chat_choice, parallel)


def test_tool_choice_tool_is_a_named_function() -> None:
    chat = translate(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert isinstance(chat.tool_choice, NamedToolChoice)
    assert chat.tool_choice.function.name == "get_weather"
    refused("tool_choice.name", tools=[WEATHER], tool_choice={"type": "tool"})
    refused("tool_choice.type", tools=[WEATHER], tool_choice={"type": "required"})


@pytest.mark.parametrize(
    "server_tool",
    [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        {"type": "computer_20250124", "name": "computer", "display_width_px": 1024},
    ],
)
def test_a_server_tool_is_refused_naming_its_type(server_tool: Any) -> None:
    err = refused("tools[1].type", tools=[WEATHER, server_tool])
    assert repr(server_tool["type"]) in err.message and "custom tool" in err.message


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"input_schema": {"type": "object"}}, "name"),
        ({"name": "f"}, "input_schema"),
        ({**WEATHER, "defer_loading": True}, "defer_loading"),
        ({**WEATHER, "allowed_callers": ["code_execution_20250825"]}, "allowed_callers"),
    ],
)
def test_a_custom_tool_needs_a_name_and_schema_and_no_server_features(
    tool: Any, param: str
) -> None:
    refused(f"tools[0].{param}", tools=[tool])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("container", "cntr_1"),
        ("mcp_servers", [{"type": "url", "url": "https://x", "name": "x"}]),
        ("context_management", {"edits": [{"type": "clear_tool_uses_20250919"}]}),
        ("diagnostics", {"previous_message_id": "msg_1"}),
        ("inference_geo", "us"),
        ("speed", "fast"),
        ("service_tier", "priority"),
    ],
)
def test_a_field_for_what_the_server_lacks_is_refused(field: str, value: Any) -> None:
    err = refused(field, **{field: value})
    assert "leave it out" in err.message


def test_accepted_fields_change_nothing_they_should_not() -> None:
    plain = translate()
    accepted = translate(
        cache_control={"type": "ephemeral"},
        service_tier="standard_only",
        speed="standard",
        workspace_id="wrkspc_1",
        user_profile_id="p",
        thinking={"type": "disabled"},
        mcp_servers=[],
        container=None,
        an_unknown_field=1,
    )
    assert accepted == plain


def test_output_config_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = translate(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert chat.response_format is not None and chat.response_format.schema() == schema
    refused("output_config.format.type", output_config={"format": {"type": "text"}})
    refused("output_config.format.schema", output_config={"format": {"type": "json_schema"}})
    refused("output_config.effort", output_config={"effort": "high"})


@pytest.mark.parametrize(
    ("thinking", "param", "words"),
    [
        ({"type": "enabled"}, "thinking.budget_tokens", "required"),
        ({"type": "enabled", "budget_tokens": 1023}, "thinking.budget_tokens", ">= 1024, got 1023"),
        (
            {"type": "enabled", "budget_tokens": 2048},
            "thinking.budget_tokens",
            "< max_tokens (2048), got 2048",
        ),
        ({"type": "adaptive", "display": "omitted"}, "thinking.display", "'omitted'"),
        ({"type": "sometimes"}, "thinking.type", "got 'sometimes'"),
    ],
)
def test_thinking_is_checked_as_anthropic_checks_it(thinking: Any, param: str, words: str) -> None:
    err = refused(param, thinking=thinking, max_tokens=2048)
    assert words in err.message


def test_thinking_within_its_budget_is_vllms_thinking_token_budget() -> None:
    enabled = {"type": "enabled", "budget_tokens": 1024}
    chat = translate(thinking=enabled, max_tokens=1025)
    assert chat.thinking_token_budget == 1024
    assert msgspec.structs.replace(chat, thinking_token_budget=None) == translate(max_tokens=1025)
    assert translate(thinking={"type": "adaptive"}).thinking_token_budget is None
    translate(CountTokensRequest, thinking=enabled)  # no max_tokens to be under


def test_check_thinking_needs_a_reasoning_parser() -> None:
    body = {"model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "x"}]}

    def request(thinking: Any) -> MessagesRequest:
        return decode_request(msgspec.json.encode({**body, "thinking": thinking}), MessagesRequest)

    enabled = request({"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(RequestError, match="no reasoning parser") as info:
        check_thinking(enabled, None)
    assert info.value.param == "thinking" and info.value.status == 400
    check_thinking(request({"type": "adaptive"}), None)  # the model may choose not to think
    check_thinking(enabled, "qwen3")
    check_thinking(request({"type": "disabled"}), None)
    check_thinking(request(None), None)


def test_a_token_count_request_translates_without_sampling_fields() -> None:
    chat = translate(CountTokensRequest, tools=[WEATHER], system="S")
    assert chat.max_tokens is None and chat.stop is None and chat.tools is not None
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert count_tokens_response(12) == b'{"input_tokens":12}'


@pytest.mark.parametrize("missing", ["model", "max_tokens", "messages"])
def test_a_required_field_missing_is_a_400_naming_it(missing: str) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    del body[missing]
    with pytest.raises(RequestError, match=f"^{missing} is required$"):
        decode_request(msgspec.json.encode(body), MessagesRequest)


# -- the face -------------------------------------------------------------------------------


def outputs(pieces: list[str], finish: str = "stop", stop: str | int | None = None) -> list[Output]:
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(
            Output(
                index=0,
                text=text,
                token_ids=[i],
                finish_reason=finish if last else None,
                stop_reason=stop if last else None,
                num_prompt_tokens=9,
                num_output_tokens=i + 1,
                num_cached_tokens=4,
            )
        )
    return out


def turn(reasoning: str | None = "qwen3") -> TurnBlocks:
    return TurnBlocks(ChatOutputParser(reasoning_parser=reasoning, tool_names={"get_weather"}))


def sse(data: bytes) -> list[tuple[str, Any]]:
    """(event name, data as parsed JSON) of each event in `data`."""
    events = []
    for chunk in data.decode().split("\n\n"):
        if not chunk:
            continue
        name, body = chunk.split("\n")
        assert name.startswith("event: ") and body.startswith("data: ")
        events.append((name[len("event: ") :], json.loads(body[len("data: ") :])))
    return events


def streamed(face: MessagesFace, blocks: TurnBlocks, pieces: list[Output]) -> bytes:
    data = face.started(blocks)
    for output in pieces:
        data += face.events(blocks, blocks.feed(output))
    return data + face.ended(blocks)


@pytest.mark.parametrize("split", [1, 3, len(PIECES)])
def test_the_stream_validates_and_assembles_into_the_whole_message(split: int) -> None:
    face, blocks = MessagesFace("m"), turn()
    pieces = ["".join(PIECES[:split]), *PIECES[split:]]
    data = streamed(face, blocks, outputs(pieces))
    events = sse(data)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    snapshot = None
    for name, body in events:
        assert body["type"] == name
        if name == "ping":
            continue
        snapshot = accumulate_event(
            event=EVENTS.validate_python(body), current_snapshot=snapshot, json_bufs={}
        )
    whole = Message.model_validate_json(face.whole(blocks))
    assert snapshot is not None and snapshot.model_dump() == whole.model_dump()
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = whole.content
    assert thinking.type == "thinking" and thinking.thinking == "let me see"
    assert thinking.signature == ""
    assert text.type == "text" and text.text == "It is cold."
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Oslo"} and call.id.startswith("toolu_")
    assert whole.stop_reason == "tool_use" and whole.stop_sequence is None
    assert whole.id.startswith("msg_") and whole.model == "m" and whole.role == "assistant"
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens) == (9, len(pieces))
    assert usage.cache_read_input_tokens is None  # hits are private unless asked for
    assert usage.output_tokens_details is not None
    assert usage.output_tokens_details.thinking_tokens == blocks.counts.reasoning_tokens


def test_the_stream_starts_empty_and_names_every_block_by_index() -> None:
    face, blocks = MessagesFace("m"), turn()
    events = sse(streamed(face, blocks, outputs(PIECES)))
    (start,) = [body for name, body in events if name == "message_start"]
    message = start["message"]
    assert message["content"] == [] and message["stop_reason"] is None
    assert message["usage"]["output_tokens"] == 0
    starts = [(b["index"], b["content_block"]) for n, b in events if n == "content_block_start"]
    assert [(i, b["type"]) for i, b in starts] == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert starts[2][1]["input"] == {} and starts[1][1]["text"] == ""
    stops = [b["index"] for n, b in events if n == "content_block_stop"]
    assert stops == [0, 1, 2]
    deltas = [b["delta"] for n, b in events if n == "content_block_delta" and b["index"] == 2]
    assert [d["type"] for d in deltas] == ["input_json_delta"]
    assert json.loads(deltas[0]["partial_json"]) == {"city": "Oslo"}
    (end,) = [body for name, body in events if name == "message_delta"]
    assert end["usage"]["input_tokens"] == 9  # the prompt's count, known by now


@pytest.mark.parametrize(
    ("finish", "stop", "reason", "sequence"),
    [
        ("stop", None, "end_turn", None),
        ("stop", 2, "end_turn", None),  # a stop token id is the model's own end
        ("stop", "END", "stop_sequence", "END"),
        ("length", None, "max_tokens", None),
    ],
)
def test_stop_reasons(
    finish: str, stop: str | int | None, reason: str, sequence: str | None
) -> None:
    face, blocks = MessagesFace("m"), turn(None)
    for output in outputs(["Hello", " there"], finish, stop):
        blocks.feed(output)
    whole = Message.model_validate_json(face.whole(blocks))
    assert (whole.stop_reason, whole.stop_sequence) == (reason, sequence)
    (_, delta), _ = sse(face.ended(blocks))
    assert delta["delta"] == {"stop_reason": reason, "stop_sequence": sequence}


def test_a_cut_call_stops_for_max_tokens() -> None:
    face, blocks = MessagesFace("m"), turn(None)
    for output in outputs(["Hi ", CALL[:30]], "length"):
        blocks.feed(output)
    whole = Message.model_validate_json(face.whole(blocks))
    assert whole.stop_reason == "max_tokens"


def test_cache_reads_show_only_when_asked_for() -> None:
    face, blocks = MessagesFace("m", cached_details=True), turn(None)
    for output in outputs(["Hello"]):
        blocks.feed(output)
    usage = Message.model_validate_json(face.whole(blocks)).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (5, 4)  # 9 in all
    assert usage.cache_creation_input_tokens == 0


def test_an_aborted_turn_is_an_error_not_a_message() -> None:
    face, blocks = MessagesFace("m"), turn(None)
    for output in outputs(["Hel", "lo"], "abort"):
        blocks.feed(output)
    with pytest.raises(RequestError, match="aborted") as info:
        face.whole(blocks)
    assert info.value.status == 503
    ((name, body),) = sse(face.ended(blocks))
    assert name == "error" and body["error"]["type"] == "overloaded_error"


def test_a_failed_stream_ends_with_anthropics_error_event() -> None:
    face, blocks = MessagesFace("m"), turn(None)
    ((name, body),) = sse(face.failed(blocks, RequestError(400, "the prompt is too long")))
    assert name == "error"
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the prompt is too long"},
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_bodies_have_anthropics_types(status: int, kind: str) -> None:
    body = json.loads(anthropic_error_body(RequestError(status, "what went wrong")))
    assert body == {"type": "error", "error": {"type": kind, "message": "what went wrong"}}
