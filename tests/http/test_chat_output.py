"""Reasoning and tool calls split off a chat choice's text, whole and streamed, and output
constraints that start once the reasoning ends."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from trillm.engine.client import StructuredOutputs
from trillm.engine.client.inputs._structured import after_reasoning, free_text
from trillm.http.turn._chat_output import ChatOutputParser, ChatParts

from ..grammars import accepts


def run(parser: ChatOutputParser, text: str, piece: int) -> ChatParts:
    parts = ChatParts()
    for i in range(0, len(text), piece):
        parts.add(parser.feed(text[i : i + piece]))
    parts.add(parser.finish())
    return parts


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_qwen3_takes_an_explicit_think_block_out(piece: int) -> None:
    parts = run(ChatOutputParser(reasoning_parser="qwen3", tool_names=None),
                "<think>Two plus two.</think>\n\nIt is 4.", piece)  # fmt: skip
    assert (parts.reasoning, parts.content) == ("Two plus two.", "It is 4.")
    plain = run(ChatOutputParser(reasoning_parser="qwen3", tool_names=None), "No tags <b>", piece)
    assert (plain.reasoning, plain.content) == ("", "No tags <b>")


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_deepseek_r1_starts_inside_the_reasoning(piece: int) -> None:
    parser = ChatOutputParser(reasoning_parser="deepseek_r1", tool_names=None)
    parts = run(parser, "Let me see </th...</think>Answer: yes", piece)
    assert (parts.reasoning, parts.content) == ("Let me see </th...", "Answer: yes")
    unfinished = run(ChatOutputParser(reasoning_parser="deepseek_r1", tool_names=None),
                     "still thinking", piece)  # fmt: skip
    assert (unfinished.reasoning, unfinished.content) == ("still thinking", "")


def test_reasoning_then_a_tool_call() -> None:
    parser = ChatOutputParser(reasoning_parser="qwen3", tool_names={"get_time"})
    text = (
        '<think>I need the time.</think><tool_call>{"name": "get_time", "arguments": {}}'
        "</tool_call>"
    )
    parts = run(parser, text, 4)
    assert parts.reasoning == "I need the time." and parts.content == ""
    assert [c.name for c in parser.tool_calls] == ["get_time"]
    assert parts.tool_calls[0]["function"]["name"] == "get_time"


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2': use one of"):
        ChatOutputParser(reasoning_parser="r2", tool_names=None)


@pytest.mark.parametrize("mode", ["qwen3", "deepseek_r1"])
def test_a_grammar_applies_after_the_reasoning(mode: str, ll_tokenizer: object) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = after_reasoning(StructuredOutputs(json=schema).to_grammar(), mode)
    start = "<think>" if mode == "qwen3" else ""
    thought = start + 'free text, even {"a": "x"} and <b>tags</b>'
    assert accepts(grammar, thought + '</think>\n{"a": 12}', ll_tokenizer)  # type: ignore[arg-type]
    assert not accepts(grammar, thought + '</think>{"a": "twelve"}', ll_tokenizer)  # type: ignore[arg-type]
    assert accepts(grammar, '{"a": 1}', ll_tokenizer) == (mode == "qwen3")  # type: ignore[arg-type]
    assert json.loads(grammar)["grammars"][0]["name"] == "reasoning"


@pytest.mark.parametrize("mode", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_thinking_budget_closes_the_reasoning_at_its_count(
    mode: str, budget: int, ll_tokenizer: Any
) -> None:
    """After `budget` tokens of thought the mask holds only </think>; a thought the model
    closes itself within the budget ends there, and free text follows either way. (A model's
    own close counts toward the budget: here </think> is three tokens; a reasoning model's is
    one special token.)"""
    grammar = after_reasoning(free_text(mode), mode, budget)
    start = "<think>" if mode == "qwen3" else ""
    words = ll_tokenizer.tokenize_str(" one two three four five six seven")
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(ll_tokenizer.tokenize_str(start))
    assert matcher.consume_tokens(words[:budget])
    assert matcher.compute_ff_bytes() == b"</think>"  # only the close may follow now
    assert matcher.validate_tokens(words[budget : budget + 1]) == 0
    if budget >= 4:  # room for a word and the model's own </think> (three tokens here)
        assert accepts(grammar, start + " one</think> answer", ll_tokenizer)
    assert accepts(
        grammar, start + ll_tokenizer.decode_str(words[:budget]) + "</think>\nok", ll_tokenizer
    )


@pytest.mark.parametrize("mode", ["qwen3", "deepseek_r1"])
def test_a_lark_grammar_applies_after_the_reasoning(mode: str, ll_tokenizer: object) -> None:
    """A tool call's grammar is Lark text, not llguidance's JSON: it was a JSONDecodeError
    (a 500) under a reasoning parser with tool_choice required or named."""
    lark = 'start: call\ncall: "<tool_call>\\n" %json {"type": "object"} "\\n</tool_call>"\n'
    grammar = after_reasoning(lark, mode)
    start = "<think>" if mode == "qwen3" else ""
    call = '<tool_call>\n{"a": 1}\n</tool_call>'
    assert accepts(grammar, start + "a thought</think>\n" + call, ll_tokenizer)  # type: ignore[arg-type]
    assert not accepts(grammar, start + "a thought</think>\nplain text", ll_tokenizer)  # type: ignore[arg-type]
