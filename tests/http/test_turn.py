"""The shared turn model (`TurnBlocks`) and the Responses API's face, fed engine outputs.

The oracle for the wire shape is the openai SDK's own event and response types: every event
the face writes must validate as a `ResponseStreamEvent`, and the whole body as a `Response`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from trillm.engine.client import Output
from trillm.http.responses._api import ResponsesRequest
from trillm.http.responses._face import ResponsesFace
from trillm.http.turn._chat_output import ChatOutputParser
from trillm.http.turn._turn import TurnBlocks

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
PIECES = ["<think>", "let me", " see</think>", "\n\nIt is ", "noon.", "\n" + CALL[:20], CALL[20:]]


def outputs(pieces: list[str]) -> list[Output]:
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(Output(0, text, [i], "stop" if last else None, None, None, 9, i + 1, 0))
    return out


def turn() -> TurnBlocks:
    return TurnBlocks(ChatOutputParser(reasoning_parser="qwen3", tool_names={"get_time"}))


def test_a_turn_is_reasoning_text_and_a_call_in_the_order_written() -> None:
    blocks = turn()
    events = [e for o in outputs(PIECES) for e in blocks.feed(o)]
    assert [(b.kind, b.text) for b in blocks.blocks[:2]] == [
        ("reasoning", "let me see"),
        ("text", "It is noon."),
    ]
    call = blocks.blocks[2].call
    assert call is not None and json.loads(call.arguments) == {"zone": "UTC"}
    starts = [e.block.index for e in events if e.kind == "start"]
    stops = [e.block.index for e in events if e.kind == "stop"]
    assert starts == stops == [0, 1, 2]  # each block closed before the next opened
    assert blocks.called and blocks.counts.output_tokens == len(PIECES)
    assert blocks.counts.reasoning_tokens == 2  # "let me" and " see</think>" only


@pytest.mark.parametrize("split", [1, 3, len(PIECES)])
def test_the_streamed_events_validate_and_assemble_into_the_whole_response(split: int) -> None:
    config = SimpleNamespace(served_model_name="m", enable_prompt_tokens_details=False)
    request = ResponsesRequest(input="x", stream=True)
    face, blocks = ResponsesFace(request, config, None, []), turn()
    data = face.started(blocks)
    for o in outputs(["".join(PIECES[:split]), *PIECES[split:]]):
        data += face.events(blocks, blocks.feed(o))
    data += face.ended(blocks)
    events = []
    for frame in data.decode().strip().split("\n\n"):
        head, body = frame.split("\n", 1)
        event = EVENTS.validate_python(json.loads(body.removeprefix("data: ")))
        assert head == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert (reasoning, text, final.output_text) == ("let me see", "It is noon.", "It is noon.")
    assert json.loads(arguments) == {"zone": "UTC"}
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [item.id for item in final.output]  # the same ids, streamed and whole


def test_the_whole_body_is_a_response_with_usage() -> None:
    config = SimpleNamespace(served_model_name="m", enable_prompt_tokens_details=True)
    face, blocks = ResponsesFace(ResponsesRequest(input="x"), config, None, []), turn()
    for o in outputs(PIECES):
        blocks.feed(o)
    response = Response.model_validate_json(face.whole(blocks))
    assert response.status == "completed" and response.output_text == "It is noon."
    assert response.usage is not None and response.usage.input_tokens == 9
    assert response.usage.output_tokens_details.reasoning_tokens == 2
