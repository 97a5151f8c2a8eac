"""Tool calling's pure parts: grammars that admit exactly the calls, parsing, streaming."""

from __future__ import annotations

import json

import llguidance
import pytest

from trillm.http.turn._constraints import (
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Tool,
    constraint,
)
from trillm.http.turn._tools import (
    ToolCallStream,
    auto_grammar,
    parse_tool_calls,
    render_tool_messages,
    required_grammar,
    tool_system_prompt,
)

from ..grammars import accepts

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


def test_the_required_grammar_admits_calls_of_offered_functions_only(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    grammar = required_grammar([WEATHER, TIME], parallel=False)
    call = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>"
    )
    assert accepts(grammar, call, ll_tokenizer)
    assert not accepts(grammar, call.replace("get_weather", "get_news"), ll_tokenizer)
    assert not accepts(grammar, call.replace("celsius", "kelvin"), ll_tokenizer)
    assert not accepts(grammar, "Sure! " + call, ll_tokenizer)
    two = call + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert not accepts(grammar, two, ll_tokenizer)
    assert accepts(required_grammar([WEATHER, TIME], parallel=True), two, ll_tokenizer)


def test_a_named_tool_choice_admits_exactly_one_call_even_with_parallel_calls_on(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    tools = [Tool("function", FunctionDef(**WEATHER)), Tool("function", FunctionDef(**TIME))]
    named = NamedToolChoice("function", NamedFunction("get_time"))
    made = constraint(structured_outputs=None, response_format=None, tools=tools, tool_choice=named)
    assert made is not None and made.grammar is not None
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(made.grammar, call, ll_tokenizer)
    assert not accepts(made.grammar, call + "\n" + call, ll_tokenizer)
    assert not accepts(made.grammar, call.replace("get_time", "get_weather"), ll_tokenizer)


def test_the_auto_grammar_leaves_text_free_and_constrains_strict_calls(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    grammar = auto_grammar([WEATHER])
    assert grammar is not None
    assert accepts(grammar, "Just text, no call.", ll_tokenizer)
    good = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "celsius"}}\n</tool_call>'
    )
    assert accepts(grammar, good, ll_tokenizer)
    assert not accepts(grammar, good.replace('"celsius"', "42"), ll_tokenizer)
    assert auto_grammar([]) is None


def test_parsing_takes_the_calls_out_of_the_content() -> None:
    text = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text, {"get_time"})
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {})]
    assert calls[0].id.startswith("call_")
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(unknown, {"get_time"}) == (unknown, [])
    broken = "<tool_call>{not json</tool_call>"
    assert parse_tool_calls(broken, {"get_time"}) == (broken, [])


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_deltas_assemble_into_the_parsed_calls(piece: int) -> None:
    text = (
        'A <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        " and <tool_ca"
    )
    stream = ToolCallStream({"get_weather", "get_time"})
    content, calls = "", {}  # index -> assembled call
    for i in range(0, len(text), piece):
        new, deltas = stream.feed(text[i : i + piece])
        content += new
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            if "id" in delta:
                assert call["name"] == "" and delta["type"] == "function"
                call["id"], call["name"] = delta["id"], delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    rest, more = stream.finish()
    content += rest
    assert more == []
    _, parsed = parse_tool_calls(text, {"get_weather", "get_time"})
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (p.name, json.loads(p.arguments)) for p in parsed
    ]
    assert content == "A \n and <tool_ca"


def test_templates_without_tools_get_them_described_and_rendered() -> None:
    prompt = tool_system_prompt([WEATHER])
    assert "<tool_call>" in prompt and '"name": "get_weather"' in prompt
    messages = render_tool_messages(
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    assert messages[1] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call>",
    }
    assert messages[2] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_streamed_calls_carry_no_separator_content(piece: int) -> None:
    from trillm.http.turn._chat_output import ChatOutputParser

    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for text, expected in [
        (f"{call}\n{call}", ""),  # only calls: no content at all, as the whole response
        (f"\n {call}\n\n{call}\n", ""),
        (f"Checking.\n{call}", "Checking."),
        (f"{call}\nDone, at noon.  ", "Done, at noon."),  # stripped, as the whole response
        ("no call here \n", "no call here \n"),  # without a call the whitespace is content
    ]:
        parser = ChatOutputParser(reasoning_parser=None, tool_names={"get_time"})
        content, calls = "", 0
        for i in range(0, len(text), piece):
            parts = parser.feed(text[i : i + piece])
            content += parts.content
            calls += sum("id" in d for d in parts.tool_calls)
        rest = parser.finish()
        content += rest.content
        calls += sum("id" in d for d in rest.tool_calls)
        assert content == expected, (text, piece)
        assert calls == text.count("<tool_call>")


@pytest.mark.parametrize(
    ("text", "content", "arguments", "complete"),
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UT', "", '{"zone": "UT', False),
        ('Now: <tool_call>\n{"name": "get_time", "argu', "Now: ", "", False),
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool', "", None, True),
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}', "", None, True),
        ('<tool_call>\n{"name": "get_ti', "", None, None),  # cut opening an offered call
        ('Hi <tool_call>\n{"', "Hi ", None, None),
        ('<tool_call>\n{"name": "set_', '<tool_call>\n{"name": "set_', None, None),
        (
            '<tool_call>\n{"name": "x", "arguments": {',
            '<tool_call>\n{"name": "x", "arguments": {',
            None,
            None,
        ),
    ],
)
def test_a_call_the_token_limit_cut_is_an_incomplete_call(
    text: str, content: str, arguments: str | None, complete: bool | None
) -> None:
    """Cut (finish reason "length"): a block that named an offered function is that call, its
    arguments as far as they came; without the cut the same text is content, as ever."""
    stream = ToolCallStream({"get_time"})
    said, _ = stream.feed(text)
    rest, deltas = stream.finish(cut=True)
    if complete is None:  # no offered function named yet: no call, and text only if no call
        assert said + rest == content and not stream.calls and not deltas
        return
    (call,) = stream.calls
    assert said + rest == content and call.name == "get_time" and call.complete is complete
    assert call.arguments == (arguments if arguments is not None else '{"zone": "UTC"}')
    assert "".join(d["function"]["arguments"] for d in deltas) == call.arguments
    uncut = ToolCallStream({"get_time"})
    assert "".join(uncut.feed(text)[0] + uncut.finish()[0]) == text and not uncut.calls
