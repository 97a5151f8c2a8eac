"""Tool calls in Llama 3.1's JSON format: grammar, parsing, streaming, and through the server."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import openai
import pytest

from trillm.http.turn._tools_llama3 import Llama3CallStream, parse_calls, required_grammar

from ..grammars import accepts
from .conftest import start_server

TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
NEWS = {
    "name": "get_news",
    "parameters": {
        "type": "object",
        "properties": {"topic": {"type": "string", "maxLength": 8}},
        "required": ["topic"],
        "additionalProperties": False,
    },
}


def test_the_grammar_admits_llama3_calls_only(ll_tokenizer: llguidance.LLTokenizer) -> None:
    grammar = required_grammar([TIME, NEWS], parallel=True)
    one = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert accepts(grammar, one, ll_tokenizer)
    assert accepts(
        grammar, one + '; {"name": "get_news", "parameters": {"topic": "ai"}}', ll_tokenizer
    )
    assert not accepts(grammar, one.replace("UTC", "PST"), ll_tokenizer)
    assert not accepts(grammar, '{"name": "get_time", "arguments": {"zone": "UTC"}}', ll_tokenizer)


def test_parsing_takes_a_reply_of_calls_and_leaves_anything_else() -> None:
    calls = parse_calls(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', {"get_time"}
    )
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "CET"})
    ]
    assert parse_calls('{"name": "get_time", "parameters": {}} and then text', {"get_time"}) is None
    assert parse_calls('{"answer": 42}', {"get_time"}) is None
    assert parse_calls("Plain words.", {"get_time"}) is None


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_streaming_holds_a_call_back_and_lets_content_through(piece: int) -> None:
    text = ' {"name": "get_time", "parameters": {"zone": "UTC"}}'
    stream = Llama3CallStream({"get_time"})
    assert all(stream.feed(text[i : i + piece]) == ("", []) for i in range(0, len(text), piece))
    content, deltas = stream.finish()
    assert content == "" and deltas[0]["function"]["name"] == "get_time"
    assert json.loads(deltas[1]["function"]["arguments"]) == {"zone": "UTC"}
    prose = Llama3CallStream({"get_time"})
    out = "".join(prose.feed(c)[0] for c in "Hello {there}")
    assert out + prose.finish()[0] == "Hello {there}"


def test_a_server_with_the_llama3_parser_returns_valid_calls(tiny_model: Path) -> None:
    server = start_server(tiny_model, "--tool-call-parser", "llama3_json")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        tools = [{"type": "function", "function": f} for f in (TIME, NEWS)]
        for seed in (1, 2):
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "News?"}], tools=tools,  # type: ignore[arg-type]
                tool_choice="required", max_tokens=120, seed=seed, parallel_tool_calls=False,
            )  # fmt: skip
            assert reply.choices[0].finish_reason == "tool_calls"
            (call,) = reply.choices[0].message.tool_calls or []
            schema = {"get_time": TIME, "get_news": NEWS}[call.function.name]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
    finally:
        assert server.stop() == 0


def test_a_reply_the_token_limit_cut_ends_in_an_incomplete_call() -> None:
    names = {"get_time"}
    text = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "param'
    stream = Llama3CallStream(names)
    assert stream.feed(text) == ("", [])
    assert stream.finish() == (text, [])  # not cut: not calls, so content
    stream = Llama3CallStream(names)
    stream.feed(text)
    assert stream.finish(cut=True)[0] == ""
    first, last = stream.calls
    assert (first.complete, first.arguments) == (True, '{"zone": "UTC"}')
    assert (last.complete, last.arguments, last.name) == (False, "", "get_time")
