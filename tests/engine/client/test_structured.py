"""The frontend's side of structured outputs: constraints to grammars, and the checks that make
a bad one a 400 before the engine sees it."""

from __future__ import annotations

import json

import llguidance
import pytest
import trio

from trillm.engine.client.inputs._structured import (
    MAX_GRAMMAR_BYTES,
    GrammarChecker,
    StructuredOutputError,
    StructuredOutputs,
)


def test_exactly_one_constraint_is_taken() -> None:
    with pytest.raises(StructuredOutputError, match=r"exactly one of .*; got regex, choice"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(StructuredOutputError, match="got none"):
        StructuredOutputs()


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputs(json='{"type": "array", "items": {"enum": ["x", "y"]}}'),
        StructuredOutputs(json_object=True),
        StructuredOutputs(regex=r"\d{3}-[a-z]+"),
        StructuredOutputs(choice=["yes", "no", 'say "maybe"']),
        StructuredOutputs(grammar='start: "a" b\nb: "b"+'),
        StructuredOutputs(grammar='root ::= "x" [0-9]+'),  # GBNF, converted
    ],
)
async def test_valid_constraints_pass_the_check(
    constraint: StructuredOutputs, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    grammar = await GrammarChecker(ll_tokenizer, timeout=30).check(constraint)
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""


@pytest.mark.parametrize(
    ("constraint", "field", "message"),
    [
        (StructuredOutputs(json="{not json"), "structured_outputs.json", "is not JSON"),
        (StructuredOutputs(json=[1, 2]), "structured_outputs.json", "must be an object"),
        (
            StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
            "structured_outputs.json",
            "invalid structured_outputs.json",
        ),
        (StructuredOutputs(regex="(unclosed"), "structured_outputs.regex", "invalid"),
        (StructuredOutputs(choice=["", "b"]), "structured_outputs.choice", "non-empty strings"),
        (StructuredOutputs(choice=[]), "structured_outputs.choice", "non-empty strings"),
        (
            StructuredOutputs(grammar="start: undefined_rule"),
            "structured_outputs.grammar",
            "invalid structured_outputs.grammar: .*undefined_rule",
        ),
    ],
)
async def test_invalid_constraints_name_the_field(
    constraint: StructuredOutputs, field: str, message: str, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    with pytest.raises(StructuredOutputError, match=message) as info:
        await GrammarChecker(ll_tokenizer, timeout=30).check(constraint)
    assert info.value.field == field


async def test_a_schema_over_the_byte_limit_is_refused_before_compiling(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    big = {"type": "object", "description": "x" * MAX_GRAMMAR_BYTES}
    with pytest.raises(StructuredOutputError, match=f"the limit is {MAX_GRAMMAR_BYTES} bytes"):
        await GrammarChecker(ll_tokenizer, timeout=30).check(StructuredOutputs(json=big))


async def test_a_check_past_its_timeout_fails_naming_the_flag(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    checker = GrammarChecker(ll_tokenizer, timeout=0)  # nothing finishes in 0 s
    with pytest.raises(StructuredOutputError, match="took longer than 0 s") as info:
        await checker.check(StructuredOutputs(json={"type": "object"}))
    assert "--structured-outputs-timeout" in str(info.value)
    with trio.fail_after(30):  # the event loop was never blocked by the abandoned thread
        await trio.sleep(0)


def test_json_is_compact_like_json_dumps() -> None:
    grammar = StructuredOutputs(json={"type": "object"}).to_grammar()
    assert json.loads(grammar)  # llguidance's grammar is JSON text
    assert '"whitespace_flexible":false' in grammar.replace(" ", "")
