"""No request field is silently ignored (issue 47), for the Structs nested in chat and
completions requests: a message's (`ChatMessage`, `ContentPart`, `MessageToolCall`,
`ToolCallFunction`), a tool's (`Tool`, `FunctionDef`), a named tool choice's
(`NamedToolChoice`, `NamedFunction`) and a response format's (`ResponseFormat`,
`JsonSchemaFormat`).

Each field either shows its effect in a live response or is a 400 whose `param` names it.
The server runs under `--chat-template` with `TEMPLATE`, which prints every message and tool
field it is given, so that a field's effect on the prompt is read back from the prompt's own
text (`prompt_token_ids` of a chat completion, through `/detokenize`). `CHECKS` maps each
(Struct, field) to a check; `test_every_nested_field_has_a_check` compares it with
`msgspec.structs.fields`, so a field added later without a check fails. Where a check
mirrors one of vLLM's tests (tests/entrypoints/openai), its docstring names it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from trillm.http.openai import _requests as R
from trillm.http.turn import _constraints as C

from .conftest import Server, start_server

# Every field a message or a tool carries, printed; "tools" in it makes the server hand the
# template the tools (and the calls as they were sent) instead of describing them itself.
TEMPLATE = """\
{%- for t in tools or [] -%}
[tool type={{ t.type }} name={{ t.function.name }} description={{ t.function.description }} \
parameters={{ t.function.parameters | tojson }} strict={{ t.function.strict }}]
{% endfor -%}
{%- for m in messages -%}
[{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}]
{%- if m.reasoning_content %}[think {{ m.reasoning_content }}]{% endif -%}
{{ m.content }}
{%- for c in m.tool_calls or [] -%}
[call id={{ c.id }} type={{ c.type }} name={{ c.function.name }} \
arguments={{ c.function.arguments | tojson }}]
{%- endfor -%}
{%- if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}[assistant]{% endif -%}
"""
ASK = {"role": "user", "content": "Tell me a saying."}
TOOL = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
CALL = {"id": "call_7", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
SCHEMA = {"enum": ["alpha", "beta"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("nested-fields") / "every_field.jinja"
    template.write_text(TEMPLATE)
    server = start_server(tiny_model, "--chat-template", str(template))
    try:
        yield server
    finally:
        server.stop()


def post(s: Server, **fields: Any) -> httpx.Response:
    body = {"messages": [ASK], **fields}
    return httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)


def ok(s: Server, **fields: Any) -> dict[str, Any]:
    r = post(s, **fields)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def refused(s: Server, param: str, **fields: Any) -> str:
    r = post(s, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def prompt(s: Server, *messages: dict[str, Any], **fields: Any) -> str:
    """The prompt the chat template rendered for `messages`, as text."""
    body = ok(s, messages=list(messages), max_tokens=1, return_token_ids=True, **fields)
    ids = body["prompt_token_ids"]
    r = httpx.post(f"{s.base_url}/detokenize", json={"tokens": ids}, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


def content(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["message"]["content"])


def calls(body: dict[str, Any]) -> list[dict[str, Any]]:
    return list(body["choices"][0]["message"]["tool_calls"])


# -- a message -----------------------------------------------------------------------------


def check_role(s: Server) -> None:
    """vLLM's test_chat.py::test_custom_role: a role the API does not name is the
    template's to render, as sent."""
    assert "[my-custom-role]Hi" in prompt(s, {"role": "my-custom-role", "content": "Hi"})
    refused(s, "messages[0].role", messages=[{"content": "Hi"}])


def check_content(s: Server) -> None:
    assert "[user]Tell me a saying." in prompt(s, ASK)
    parts = [{"type": "text", "text": "Tell me a saying."}]
    assert prompt(s, {"role": "user", "content": parts}) == prompt(s, ASK)


def check_name(s: Server) -> None:
    assert "[user name=alice]" in prompt(s, {**ASK, "name": "alice"})
    assert "name=" not in prompt(s, ASK)


def turn_of_calls(*tool_calls: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """A user turn, the assistant's calls, and the user again."""
    return ASK, {"role": "assistant", "tool_calls": list(tool_calls)}, ASK


def check_tool_calls(s: Server) -> None:
    assert "[assistant][call id=call_7 type=function name=ping" in prompt(s, *turn_of_calls(CALL))
    assert "[call" not in prompt(s, *turn_of_calls())


def check_tool_call_id(s: Server) -> None:
    answer = {"role": "tool", "content": "pong", "tool_call_id": "call_7"}
    assert "[tool]pong[answers call_7]" in prompt(s, *turn_of_calls(CALL), answer)


def check_reasoning_content(s: Server) -> None:
    """The assistant turn's reasoning reaches a template that reads it (Qwen3's does)."""
    thought = {"role": "assistant", "content": "Yes.", "reasoning_content": "Think first."}
    assert "[assistant][think Think first.]Yes." in prompt(s, ASK, thought, ASK)


# -- a content part ------------------------------------------------------------------------


def check_part_type(s: Server) -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.org/a.png"}}
    message = refused(s, "messages", messages=[{"role": "user", "content": [image]}])
    assert message == "content parts of type 'image_url' are not supported: send 'text' parts"


def check_part_text(s: Server) -> None:
    """vLLM's test_chat.py::test_complex_message_content: text parts are the content,
    joined by newlines."""
    parts = [{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}]
    assert "[user]One.\nTwo." in prompt(s, {"role": "user", "content": parts})
    message = refused(s, "messages", messages=[{"role": "user", "content": [{"type": "text"}]}])
    assert message == "a content part of type 'text' needs 'text'"


# -- a message's tool call and its function ------------------------------------------------


def check_call_function(s: Server) -> None:
    refused(s, "messages[1].tool_calls[0].function", messages=turn_of_calls({"id": "c"}))


def check_call_id(s: Server) -> None:
    assert "[call id=call_8 " in prompt(s, *turn_of_calls({**CALL, "id": "call_8"}))


def check_call_type(s: Server) -> None:
    """As sent (a call the server made is of type function), for the template to read."""
    assert " type=function name=ping" in prompt(s, *turn_of_calls(CALL))
    refused(s, "messages[1].tool_calls[0].type", messages=turn_of_calls({**CALL, "type": 1}))


def check_call_name(s: Server) -> None:
    pong = {**CALL, "function": {**CALL["function"], "name": "pong"}}
    assert " name=pong arguments=" in prompt(s, *turn_of_calls(pong))


def check_call_arguments(s: Server) -> None:
    """JSON text (OpenAI's) or an object: the template reads the object either way."""

    def with_arguments(arguments: Any) -> str:
        call = {**CALL, "function": {"name": "ping", "arguments": arguments}}
        return prompt(s, *turn_of_calls(call))

    assert 'arguments={"host": "a.example"}]' in with_arguments('{"host": "a.example"}')
    assert with_arguments({"host": "a.example"}) == with_arguments('{"host": "a.example"}')
    deep = "[" * 300 + "]" * 300  # deeper than the 256 a body may nest
    message = refused(s, "messages", messages=turn_of_calls({**CALL, "function": {
        "name": "ping", "arguments": deep}}))  # fmt: skip
    assert "function.arguments nests deeper than" in message


# -- a tool and its function ---------------------------------------------------------------


def tools_prompt(s: Server, *tools: dict[str, Any]) -> str:
    return prompt(s, ASK, tools=list(tools))


def with_function(**fields: Any) -> dict[str, Any]:
    return {**TOOL, "function": {**TOOL["function"], **fields}}


def check_tool_type(s: Server) -> None:
    assert "[tool type=function name=ping" in tools_prompt(s, TOOL)
    assert "'retrieval'" in refused(s, "tools", tools=[{**TOOL, "type": "retrieval"}])


def check_tool_function(s: Server) -> None:
    refused(s, "tools[0].function", tools=[{"type": "function"}])


def check_function_name(s: Server) -> None:
    assert "name=pong description=" in tools_prompt(s, with_function(name="pong"))
    message = refused(s, "tools", tools=[with_function(name="")])
    assert message == "a function name must be 1 to 64 characters, got ''"


def check_function_description(s: Server) -> None:
    described = with_function(description="Pings a server.")
    assert "description=Pings a server. parameters=" in tools_prompt(s, described)


def check_function_parameters(s: Server) -> None:
    """In the template's tools, and the arguments of a call follow them (vLLM's
    test_chat.py::test_named_tool_use validates the arguments against the schema)."""
    params = {"type": "object", "properties": {"host": {"enum": ["a.example"]}},
              "required": ["host"], "additionalProperties": False}  # fmt: skip
    tool = with_function(parameters=params)
    assert f"parameters={json.dumps(params)} " in tools_prompt(s, tool)
    body = ok(s, max_tokens=96, temperature=0, tools=[tool], tool_choice="required",
              parallel_tool_calls=False)  # fmt: skip
    assert [json.loads(c["function"]["arguments"]) for c in calls(body)] == [{"host": "a.example"}]


def check_function_strict(s: Server) -> None:
    """strict reaches the template's tools. Under tool_choice "auto" a strict function's
    calls have their arguments held to `parameters` by a lazy grammar from ``<tool_call>``
    on (`_tools.auto_grammar`; a non-strict one's are free); under "required" or a named
    function the grammar holds every call to its parameters, strict or not, as OpenAI's
    strict would: the output of a non-strict request may follow the schema, and here does."""
    assert "strict=True]" in tools_prompt(s, with_function(strict=True))
    assert "strict=None]" in tools_prompt(s, TOOL)
    strict = C.constraint(structured_outputs=None, response_format=None,
                          tools=[msgspec.convert(with_function(strict=True), C.Tool)])  # fmt: skip
    free = C.constraint(structured_outputs=None, response_format=None,
                        tools=[msgspec.convert(with_function(strict=False), C.Tool)])  # fmt: skip
    assert strict is not None and strict.grammar and free is None
    refused(s, "tools[0].function.strict", tools=[with_function(strict="yes")])


# -- a named tool choice -------------------------------------------------------------------

TWO_TOOLS = [TOOL, with_function(name="pong")]


def named(name: str, kind: str = "function") -> dict[str, Any]:
    return {"type": kind, "function": {"name": name}}


def check_choice_type(s: Server) -> None:
    """Only function tools are served: another type is refused, not served as one."""
    message = refused(s, "tool_choice.type", tools=[TOOL], tool_choice=named("ping", "web"))
    assert message == "tool_choice names a tool of type 'web': only 'function' tools are served"


def check_choice_function(s: Server) -> None:
    """vLLM's test_chat.py::test_inconsistent_tool_choice_and_tools."""
    refused(s, "tool_choice.function", tools=[TOOL], tool_choice={"type": "function"})


def check_choice_name(s: Server) -> None:
    """vLLM's test_chat.py::test_named_tool_use: exactly one call, of the named function."""
    for name in ("ping", "pong"):
        body = ok(s, max_tokens=48, temperature=0, tools=TWO_TOOLS, tool_choice=named(name))
        assert [c["function"]["name"] for c in calls(body)] == [name]
    message = refused(s, "tool_choice", tools=[TOOL], tool_choice=named("pong"))
    assert "not among the tools (ping)" in message


# -- a response format ---------------------------------------------------------------------


def formatted(s: Server, fmt: dict[str, Any]) -> str:
    return content(ok(s, max_tokens=12, response_format=fmt))


def with_schema(**fields: Any) -> dict[str, Any]:
    return {**FORMAT, "json_schema": {**FORMAT["json_schema"], **fields}}


def check_format_type(s: Server) -> None:
    """vLLM's test_chat.py::test_response_format_json_object."""
    assert formatted(s, {"type": "json_object"}).lstrip().startswith("{")  # cut by the limit
    free = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    assert content(ok(s, **free, response_format={"type": "text"})) == content(ok(s, **free))
    message = refused(s, "response_format.type", response_format={"type": "xml"})
    assert (
        message == "response_format.type must be 'text', 'json_object' or 'json_schema', got 'xml'"
    )


def check_format_json_schema(s: Server) -> None:
    """vLLM's test_chat.py::test_response_format_json_schema."""
    assert json.loads(formatted(s, FORMAT)) in SCHEMA["enum"]
    refused(s, "response_format.json_schema", response_format={"type": "json_schema"})


def check_schema_name(s: Server) -> None:
    """A label (OpenAI: letters, digits, _ and -, 64 at most, else 400): it names the
    format and changes no output; vLLM, too, gives it no other use."""
    assert json.loads(formatted(s, with_schema(name="a_Greek-letter"))) in SCHEMA["enum"]
    for wrong in ("a Greek letter", "x" * 65, 3):
        refused(s, "response_format.json_schema.name", response_format=with_schema(name=wrong))


def check_schema_schema(s: Server) -> None:
    assert json.loads(formatted(s, with_schema(schema={"enum": ["gamma"]}))) == "gamma"
    assert formatted(s, with_schema(schema=None)).lstrip().startswith("{")  # an object


def check_schema_strict(s: Server) -> None:
    """strict false asks for the schema at best; the grammar holds it either way, and an
    output that follows the schema is one a non-strict request may get, so false is served
    as true rather than refused (the Responses API's text.format.strict reads the same)."""
    assert json.loads(formatted(s, with_schema(strict=False))) in SCHEMA["enum"]
    assert json.loads(formatted(s, with_schema(strict=True))) in SCHEMA["enum"]
    refused(s, "response_format.json_schema.strict", response_format=with_schema(strict="no"))


def check_schema_description(s: Server) -> None:
    """What the format is for: OpenAI's model may read it; here the grammar, which holds
    the schema, is what the output follows, so it is a label, typed (vLLM, too, gives it
    no use)."""
    assert json.loads(formatted(s, with_schema(description="a letter"))) in SCHEMA["enum"]
    refused(s, "response_format.json_schema.description",
            response_format=with_schema(description=3))  # fmt: skip


CHECKS: dict[tuple[type[Any], str], Callable[[Server], None]] = {
    (R.ChatMessage, "role"): check_role,
    (R.ChatMessage, "content"): check_content,
    (R.ChatMessage, "name"): check_name,
    (R.ChatMessage, "tool_calls"): check_tool_calls,
    (R.ChatMessage, "tool_call_id"): check_tool_call_id,
    (R.ChatMessage, "reasoning_content"): check_reasoning_content,
    (R.ContentPart, "type"): check_part_type,
    (R.ContentPart, "text"): check_part_text,
    (R.MessageToolCall, "function"): check_call_function,
    (R.MessageToolCall, "id"): check_call_id,
    (R.MessageToolCall, "type"): check_call_type,
    (R.ToolCallFunction, "name"): check_call_name,
    (R.ToolCallFunction, "arguments"): check_call_arguments,
    (C.Tool, "type"): check_tool_type,
    (C.Tool, "function"): check_tool_function,
    (C.FunctionDef, "name"): check_function_name,
    (C.FunctionDef, "description"): check_function_description,
    (C.FunctionDef, "parameters"): check_function_parameters,
    (C.FunctionDef, "strict"): check_function_strict,
    (C.NamedToolChoice, "type"): check_choice_type,
    (C.NamedToolChoice, "function"): check_choice_function,
    (C.NamedFunction, "name"): check_choice_name,
    (C.ResponseFormat, "type"): check_format_type,
    (C.ResponseFormat, "json_schema"): check_format_json_schema,
    (C.JsonSchemaFormat, "name"): check_schema_name,
    (C.JsonSchemaFormat, "schema"): check_schema_schema,
    (C.JsonSchemaFormat, "strict"): check_schema_strict,
    (C.JsonSchemaFormat, "description"): check_schema_description,
}
STRUCTS = (R.ChatMessage, R.ContentPart, R.MessageToolCall, R.ToolCallFunction, C.Tool,
           C.FunctionDef, C.NamedToolChoice, C.NamedFunction, C.ResponseFormat,
           C.JsonSchemaFormat)  # fmt: skip


def test_every_nested_field_has_a_check() -> None:
    fields = {(kind, f.name) for kind in STRUCTS for f in msgspec.structs.fields(kind)}
    assert sorted((k.__name__, f) for k, f in fields - CHECKS.keys()) == []
    assert sorted((k.__name__, f) for k, f in CHECKS.keys() - fields) == []


@pytest.mark.parametrize(
    ("struct", "field"), sorted(CHECKS, key=lambda k: (k[0].__name__, k[1])),
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)  # fmt: skip
def test_the_field_works_or_is_a_400_naming_it(live: Server, struct: type[Any], field: str) -> None:
    CHECKS[(struct, field)](live)
