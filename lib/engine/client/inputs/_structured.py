"""Structured outputs in the frontend: a request's constraint becomes one llguidance grammar,
checked before the request reaches the engine.

Why here: the frontend can refuse a bad schema, regex or grammar with a 400 before a stream
starts, and a grammar that takes too long to check fails only its own request (the check
runs in a thread, under `timeout`; the busy loop never sees it). The engine compiles the
same grammar text again for its matcher (`core._grammar`), off its loop too: a matcher
cannot cross a process boundary, a grammar string can.

One request must not take the process down (DESIGN.md §8): llguidance recurses once per
link of a chain of rules or `$ref`s, so a constraint is first measured against a
`GrammarBudget` (`_grammar_budget`: depth and size, by code that cannot overflow), and the
whole check runs on a thread with a stack sized for what that budget admits (`_big_stack`).

The constraint kinds are vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
`json_object`) and the OpenAI `response_format` types, which the HTTP layer maps onto them.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import trio

from ._big_stack import run_sync_on_stack
from ._grammar_budget import MAX_GRAMMAR_BYTES as MAX_GRAMMAR_BYTES
from ._grammar_budget import GrammarBudget, GrammarBudgetError

DEFAULT_BUDGET = GrammarBudget()
MAX_CHECKED = 256  # constraints whose check is remembered
# Compact JSON like `json.dumps` writes it: a small model given "any whitespace" can emit it
# forever, and a client parses either form the same.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """The constraint is invalid, too large, or took too long to check: the caller's 400.

    Attributes:
        field: the request field at fault ("structured_outputs.json", "response_format", ...).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class StructuredOutputs(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One output constraint (exactly one field set), as vLLM's `structured_outputs`."""

    json: Any = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF/EBNF
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                "structured_outputs",
                f"structured_outputs takes exactly one of {', '.join(_KINDS)}; got "
                + (", ".join(given) if given else "none"),
            )

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    def to_grammar(self, budget: GrammarBudget = DEFAULT_BUDGET) -> str:
        """The llguidance grammar text (unchecked against a tokenizer: `GrammarChecker` does
        that), once the constraint is within `budget`.

        Run it where a deep recursion cannot overflow (`GrammarChecker` gives it a large
        stack): the budget is measured without recursion, but JSON parsing and the GBNF
        converter recurse in Python (to its recursion limit, raised here as a 400).

        Raises:
            StructuredOutputError: the constraint is malformed, or over a limit of `budget`
                (the message names the value, the limit and its flag).
        """
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

        kind = self.kind
        field = f"structured_outputs.{kind}"
        with _budget_errors(field):
            if kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
            if kind == "json":
                schema = _schema_object(field, self.json)
                budget.check_size(_dumps(field, schema))  # first: it bounds the depth's cost
                budget.check_schema(schema)
                budget.check_schema_patterns(schema)
                try:
                    return LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
                except ValueError as exc:
                    raise StructuredOutputError(field, f"invalid JSON schema: {exc}") from None
            if kind == "regex":
                regex = str(self.regex)
                budget.check_size(regex)
                budget.check_regex(regex)
                return LLMatcher.grammar_from_regex(regex)
            if kind == "choice":
                choices = list(self.choice or ())
                if not choices or not all(isinstance(c, str) and c for c in choices):
                    raise StructuredOutputError(field, "choice must be a list of non-empty strings")
                lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
                budget.check_size(lark)
                return LLMatcher.grammar_from_lark(lark)
            grammar = str(self.grammar)
            budget.check_size(grammar)
            if not is_lark_syntax(grammar):
                budget.check_gbnf(grammar)
            try:
                lark = any_to_lark(grammar)
            except Exception as exc:  # the GBNF converter raises what its parser meets
                raise StructuredOutputError(field, f"invalid grammar: {exc}") from None
            budget.check_lark(lark)
            budget.check_lark_lexemes(lark)
            return LLMatcher.grammar_from_lark(lark)


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@contextmanager
def _budget_errors(field: str) -> Iterator[None]:
    """A `GrammarBudgetError` as the request's 400: "the structured_outputs.json nests ..."."""
    try:
        yield
    except GrammarBudgetError as exc:
        raise StructuredOutputError(field, f"the {field} {exc}") from None


def _schema_object(field: str, schema: Any) -> dict[str, Any]:
    """The schema as a JSON object (parsed if it came as text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise StructuredOutputError(field, f"the JSON schema is not JSON: {exc}") from None
        except RecursionError:
            raise StructuredOutputError(
                field, "the JSON schema nests too deep to parse; flatten it with $defs"
            ) from None
    if isinstance(schema, bool):  # true: anything; false: nothing
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise StructuredOutputError(field, "the JSON schema must be an object")
    return schema


def _dumps(field: str, schema: dict[str, Any]) -> str:
    try:
        return json.dumps(schema)
    except RecursionError:  # past Python's limit (1,000): far past the default depth budget
        raise StructuredOutputError(
            field, "the JSON schema nests too deep to serialise; flatten it with $defs"
        ) from None


class GrammarChecker:
    """Checks grammars against the model's tokenizer, each in a thread, each under a deadline.

    Each check (the budget, the grammar's translation, llguidance's validation) runs on a
    thread of its own whose stack is `budget.stack_bytes`: what the budget admits cannot
    overflow it. A check that outlives its deadline is abandoned (a thread cannot be
    stopped; llguidance drops the GIL while it compiles, so an abandoned one costs a core,
    never the event loop); `max_threads` bounds how many run at once.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        timeout: float,
        budget: GrammarBudget = DEFAULT_BUDGET,
        max_threads: int = 4,
    ) -> None:
        # llguidance.LLTokenizer, or a callable that builds it (in a thread, at first use)
        self._tokenizer = None if callable(tokenizer) else tokenizer
        self._build = tokenizer if callable(tokenizer) else None
        self._build_lock = trio.Lock()
        self.timeout = timeout
        self.budget = budget
        self._limiter = trio.CapacityLimiter(max_threads)
        self._checked: OrderedDict[bytes, str] = OrderedDict()  # constraint -> its grammar

    async def check(self, constraint: StructuredOutputs) -> str:
        """The constraint's llguidance grammar, valid for this model (checked once per
        distinct constraint: a client that repeats a schema pays for one check).

        Raises:
            StructuredOutputError: invalid, too large, or not checked within `timeout`.
        """
        key = msgspec.json.encode(constraint)
        if (grammar := self._checked.get(key)) is not None:
            self._checked.move_to_end(key)
            return grammar
        grammar = await self._check(constraint, f"structured_outputs.{constraint.kind}")
        self._checked[key] = grammar
        while len(self._checked) > MAX_CHECKED:
            self._checked.popitem(last=False)
        return grammar

    async def _check(self, constraint: StructuredOutputs, field: str) -> str:
        async with self._build_lock:
            if self._tokenizer is None and self._build is not None:
                self._tokenizer = await trio.to_thread.run_sync(self._build)
        with trio.move_on_after(self.timeout) as scope:
            grammar, is_error, messages = await run_sync_on_stack(
                self._validate,
                constraint,
                stack_bytes=self.budget.stack_bytes,
                limiter=self._limiter,
                name="trillm-grammar-check",
            )
        if scope.cancelled_caught:
            raise StructuredOutputError(
                field,
                f"compiling the {field} took longer than {self.timeout:g} s "
                f"(--structured-outputs-timeout); simplify it",
            )
        if is_error:
            raise StructuredOutputError(field, f"invalid {field}: {messages[0]}")
        return grammar

    def _validate(self, constraint: StructuredOutputs) -> tuple[str, bool, list[str]]:
        """The constraint's grammar and llguidance's verdict on it (in the checking thread)."""
        from llguidance import LLMatcher

        grammar = constraint.to_grammar(self.budget)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            return grammar, is_error, messages
        # Validation does not build the lexer; the engine's matcher does, and can still refuse
        # ("lexer precomputation failed"): built here too (about 1 ms for a typical schema),
        # that is a 400 now, not a stream that ends in an error.
        assert self._tokenizer is not None  # built by `_check` before any validation
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return grammar, True, [matcher.get_error()]
        return grammar, False, messages


REASONING_PARSERS = ("deepseek_r1", "qwen3")
# The reasoning before a grammar: Lark whose lazy `think` ends at the first </think>, then the
# constrained part (grammar "inner"). deepseek_r1 starts inside the reasoning; qwen3 may open
# an explicit <think> block, or skip it.
_REASONING_LARK = {
    "deepseek_r1": 'start: think SPACE? @inner\nthink[lazy]: TEXT "</think>"\n',
    "qwen3": 'start: (think SPACE?)? @inner\nthink[lazy]: "<think>" TEXT "</think>"\n',
}
# With a thinking budget the thought is a lexeme of at most that many tokens that the model's
# own </think> ends (its `stop`); at the budget the grammar then writes </think> itself.
_BUDGETED_LARK = {
    "deepseek_r1": 'start: think SPACE? @inner\nthink: thought "</think>"\n',
    "qwen3": 'start: (think SPACE?)? @inner\nthink: "<think>" thought "</think>"\n',
}


def free_text(reasoning_parser: str) -> str:
    """The inner grammar of a request with a thinking budget and no constraint: any text, but
    for qwen3 none that opens with <think> (whose thought is optional: a <think> that the
    free text could also take would leave the budget unenforced)."""
    if reasoning_parser != "qwen3":
        return json.dumps({"grammars": [{"lark_grammar": "start: /(.|\\n)*/\n"}]})
    tag = "<think>"
    diverging = [re.escape(tag[:k]) + f"[^{re.escape(tag[k])}]" for k in range(len(tag))]
    prefixes = [re.escape(tag[:k]) for k in range(1, len(tag))]
    regex = f"(?:{'|'.join(diverging)})(?:.|\\n)*|{'|'.join(prefixes)}|"
    regex = regex.replace("/", "\\/")
    return json.dumps({"grammars": [{"lark_grammar": f"start: /{regex}/\n"}]})


def after_reasoning(grammar: str, reasoning_parser: str, budget: int | None = None) -> str:
    """`grammar` (llguidance's JSON form) applied only once the reasoning has ended: the mask
    allows any text until ``</think>``, then holds the output to `grammar`. With a `budget`
    (vLLM's thinking_token_budget), the reasoning ends after at most that many tokens: the
    mask then allows only ``</think>``. `grammar` may also be a Lark grammar's text (the
    tool calls' grammars, a `grammar` constraint in llguidance's Lark): it becomes the inner
    grammar as it is (as JSON it was a 500 under a reasoning parser)."""
    if grammar.lstrip().startswith("{"):
        inner = json.loads(grammar)["grammars"]
    else:
        inner = [{"lark_grammar": grammar}]
    inner[0] = {**inner[0], "name": "inner"}
    if budget is None:
        lark = _REASONING_LARK[reasoning_parser] + "TEXT: /(.|\\n)*/\n"
    elif budget == 0:  # no thought at all: the reasoning is closed at once
        lark = _BUDGETED_LARK[reasoning_parser].replace(" thought", "")
    else:
        thought = f'thought[stop="</think>", max_tokens={budget}]: /(.|\\n)*/\n'
        lark = _BUDGETED_LARK[reasoning_parser] + thought
    lark += "SPACE: /[ \\n]+/\n"
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *inner]})


def build_ll_tokenizer(hf_tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's tokenizer for a Hugging Face fast tokenizer (about a second: build once).

    `vocab_size` is the model's, so a mask covers every logit (padding ids included).
    """
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
