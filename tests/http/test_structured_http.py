"""Structured outputs and tool calling through `trillm serve`, with the official openai SDK.

The model is the tiny random one: whatever it emits is noise unless the grammar holds it, so
a valid output here is the mask's doing. Outputs are validated with `jsonschema`.
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
import trio

from .conftest import Server, start_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "manager": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["name", "age", "role", "tags", "manager"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Help me."}]


@pytest.fixture(scope="module")
def agent_server(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield server
    finally:
        server.stop()


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def schema_format(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
def test_json_schema_outputs_validate_streamed_and_not(agent_server: Server, schema: dict) -> None:
    client = sdk(agent_server)
    for seed in (1, 2):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=300, seed=seed,
            response_format=schema_format(schema),  # type: ignore[arg-type]
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=300, seed=3, stream=True,
        response_format=schema_format(schema),  # type: ignore[arg-type]
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_vllm_structured_outputs_on_both_endpoints(agent_server: Server) -> None:
    client = sdk(agent_server)
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert (reply.choices[0].message.content or "").startswith("{")
    choice = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )  # fmt: skip
    assert choice.choices[0].message.content in ("alpha", "beta")
    done = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{4}"}},
    )  # fmt: skip
    assert len(done.choices[0].text) == 6 and done.choices[0].text[:2].isupper()
    completed = client.completions.create(
        model="tiny", prompt="Order:", max_tokens=300,
        extra_body={"response_format": schema_format(ORDER)},
    )  # fmt: skip
    jsonschema.validate(json.loads(completed.choices[0].text), ORDER)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls_validate_against_their_parameters(
    agent_server: Server, choice: str
) -> None:
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    for seed in (1, 2, 3):
        reply = sdk(agent_server).chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,  # type: ignore[arg-type]
            max_tokens=200, seed=seed, parallel_tool_calls=False,
        )  # fmt: skip
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls"
        (call,) = choice_.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        if choice == "named":
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        assert choice_.message.content is None


def test_streamed_tool_call_deltas_assemble_into_a_valid_call(agent_server: Server) -> None:
    stream = sdk(agent_server).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=200, seed=5, stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            if part.id:
                assert call["name"] == ""  # id and name come first, once
                call["id"], call["name"] = part.id, part.function.name  # type: ignore[union-attr]
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])


def test_a_forced_call_cut_by_the_token_limit_is_an_incomplete_call(agent_server: Server) -> None:
    """OpenAI's shape for a call that max_tokens ended: the call, its arguments as far as they
    came, finish_reason "length", no content (the tags are never text), streamed or not."""
    client, named = sdk(agent_server), {"type": "function", "function": {"name": "get_weather"}}
    ask: Any = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=named, temperature=0)
    full = client.chat.completions.create(**ask, max_tokens=200)
    (whole,) = full.choices[0].message.tool_calls or []
    written = json.dumps(json.loads(whole.function.arguments), ensure_ascii=False)  # as generated
    assert full.usage is not None
    for cut_at in range(full.usage.completion_tokens - 6, 0, -3):  # back past the closing tag
        reply = client.chat.completions.create(**ask, max_tokens=cut_at)
        choice = reply.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        if call.function.arguments != whole.function.arguments:
            break
    arguments = call.function.arguments
    assert written.startswith(arguments) and arguments != written
    chunks = list(client.chat.completions.create(**ask, max_tokens=cut_at, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    streamed = "".join(
        (t.function.arguments or "") for d in deltas for t in d.tool_calls or [] if t.function
    )
    assert streamed == arguments and chunks[-1].choices[0].finish_reason == "length"


def test_a_tool_result_round_trip_gets_an_answer(agent_server: Server) -> None:
    client = sdk(agent_server)
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200,
    )  # fmt: skip
    (call,) = first.choices[0].message.tool_calls or []
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "length"
    assert not answer.choices[0].message.tool_calls
    # The template saw the call and its result (SmolLM2's knows no tools: Hermes text).
    ids = httpx.post(f"{agent_server.base_url}/tokenize", json={"messages": messages}).json()
    prompt = httpx.post(
        f"{agent_server.base_url}/detokenize", json={"tokens": ids["tokens"]}
    ).json()["prompt"]
    assert f'"name": "get_weather", "arguments": {call.function.arguments}' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt


def test_auto_tools_with_a_response_format_give_calls_or_valid_content(
    agent_server: Server,
) -> None:
    for seed in range(4):
        reply = sdk(agent_server).chat.completions.create(
            model="tiny", messages=ASK, tools=[TIME], tool_choice="auto", max_tokens=300,
            seed=seed, response_format=schema_format(PERSON),  # type: ignore[arg-type]
        )  # fmt: skip
        message = reply.choices[0].message
        if message.tool_calls:
            assert reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_time"])
        else:
            jsonschema.validate(json.loads(message.content or ""), PERSON)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {
                "response_format": schema_format(
                    {"type": "object", "properties": {"a": {"type": 7}}}
                )
            },
            "structured_outputs.json",
            "invalid structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "invalid"),
        (
            {"structured_outputs": {"grammar": "start: nothing_here"}},
            "structured_outputs.grammar",
            "invalid structured_outputs.grammar",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools (get_weather)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        (
            {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
            "response_format",
            "not both",
        ),
        (
            {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
            "structured_outputs",
            "exactly one of",
        ),
        (
            {"response_format": schema_format({"description": "x" * 300_000})},
            "structured_outputs.json",
            "the limit is 262144 bytes",
        ),
    ],
)
def test_bad_structured_input_is_a_400_naming_the_field(
    agent_server: Server, body: dict[str, object], param: str, message: str
) -> None:
    r = httpx.post(
        f"{agent_server.base_url}/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 5, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    ok = sdk(agent_server).chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason is not None  # the server goes on


def test_tools_without_a_tool_choice_are_auto_by_default_and_the_flag_refuses_them(
    server: Server, tiny_model: Path
) -> None:
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 5}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # OpenAI's default: tools present, tool_choice auto
    strict = start_server(tiny_model, "--no-enable-auto-tool-choice")
    try:
        for choice in ({}, {"tool_choice": "auto"}):
            r = httpx.post(f"{strict.base_url}/v1/chat/completions", json=body | choice, timeout=60)
            error = r.json()["error"]
            assert r.status_code == 400 and "--no-enable-auto-tool-choice" in error["message"]
            assert error["param"] == "tool_choice"
    finally:
        strict.stop()


def big_schema() -> dict[str, object]:
    """About 240 KB of nested bounded integers: some tens of ms to check on a fast CPU."""
    props = {
        f"p{i}": {
            "type": "object",
            "properties": {
                f"q{j}": {"type": "integer", "minimum": j, "maximum": 1000 + j} for j in range(40)
            },
        }
        for i in range(100)
    }
    return {"type": "object", "properties": props}


def test_a_grammar_past_the_timeout_fails_alone_while_another_is_served(
    tiny_model: Path,
) -> None:
    server = start_server(tiny_model, "--structured-outputs-timeout", "0.005")
    try:

        async def both() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                results: dict[str, httpx.Response] = {}

                async def post(name: str, body: dict[str, object]) -> None:
                    results[name] = await client.post("/v1/chat/completions", json=body)

                async with trio.open_nursery() as nursery:
                    slow = {"response_format": schema_format(big_schema())}
                    nursery.start_soon(post, "slow", {"messages": ASK, "max_tokens": 5, **slow})
                    free = {"max_tokens": 4, "ignore_eos": True}
                    nursery.start_soon(post, "free", {"messages": ASK, **free})
            return results["slow"], results["free"]

        slow, free = trio.run(both)
        assert slow.status_code == 400, slow.text
        assert "took longer than 0.005 s (--structured-outputs-timeout)" in slow.text
        assert free.status_code == 200 and free.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


def test_under_a_reasoning_parser_the_format_holds_after_the_reasoning(tiny_model: Path) -> None:
    """qwen3: the grammar is wrapped to allow a <think> block first (the tiny model skips it),
    and the content still validates; no reasoning is reported when there was none."""
    server = start_server(tiny_model, "--reasoning-parser", "qwen3")
    try:
        reply = sdk(server).chat.completions.create(
            model="tiny", messages=ASK, max_tokens=300, temperature=0,
            response_format=schema_format(ORDER),  # type: ignore[arg-type]
        )  # fmt: skip
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(message.content or ""), ORDER)
        assert getattr(message, "reasoning", None) is None
    finally:
        assert server.stop() == 0


def test_a_thinking_token_budget_closes_the_reasoning(tiny_model: Path) -> None:
    """deepseek_r1: the reply starts inside the reasoning, which the tiny model never closes;
    with vLLM's thinking_token_budget the grammar closes it after that many tokens. Greedy, the
    budgeted reasoning is the start of the unbounded one (the mask bites only at the budget)."""
    server = start_server(tiny_model, "--reasoning-parser", "deepseek_r1")
    try:
        client = sdk(server)
        ask: Any = dict(model="tiny", messages=ASK, max_tokens=40, temperature=0)
        free = client.chat.completions.create(**ask).choices[0].message
        bounded = client.chat.completions.create(**ask, extra_body={"thinking_token_budget": 6})
        message = bounded.choices[0].message
        unbounded_reasoning = getattr(free, "reasoning", None) or ""
        reasoning = getattr(message, "reasoning", None) or ""
        assert reasoning and len(reasoning) < len(unbounded_reasoning)
        assert unbounded_reasoning.startswith(reasoning)
        assert bounded.usage is not None and bounded.usage.completion_tokens > 6 + 3
        assert "</think>" not in (message.content or "")
        with pytest.raises(openai.BadRequestError, match="thinking_token_budget must be >= 0"):
            client.chat.completions.create(**ask, extra_body={"thinking_token_budget": -1})
    finally:
        assert server.stop() == 0


def test_a_thinking_token_budget_needs_a_reasoning_parser(agent_server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="no reasoning parser") as info:
        sdk(agent_server).chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4, extra_body={"thinking_token_budget": 8}
        )
    assert info.value.param == "thinking_token_budget"
