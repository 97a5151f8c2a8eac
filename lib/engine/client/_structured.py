"""Structured outputs in the frontend: a request's constraint becomes one llguidance grammar,
checked before the request reaches the engine.

Why here: the frontend can refuse a bad schema, regex or grammar with a 400 before a stream
starts, and a grammar that takes too long to check fails only its own request (the check
runs in a thread, under `timeout`; the busy loop never sees it). The engine compiles the
same grammar text again for its matcher (`core._grammar`), off its loop too: a matcher
cannot cross a process boundary, a grammar string can.

The constraint kinds are vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
`json_object`) and the OpenAI `response_format` types, which the HTTP layer maps onto them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import msgspec
import trio

MAX_GRAMMAR_BYTES = 256 * 1024  # a schema or grammar larger than this is refused (400)
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

    def to_grammar(self) -> str:
        """The llguidance grammar text (unchecked: `check_grammar` checks it).

        Raises:
            StructuredOutputError: the constraint is malformed or over `MAX_GRAMMAR_BYTES`.
        """
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        kind = self.kind
        field = f"structured_outputs.{kind}"
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise StructuredOutputError(
                        field, f"the JSON schema is not JSON: {exc}"
                    ) from None
            if isinstance(schema, bool):  # true: anything; false: nothing
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise StructuredOutputError(field, "the JSON schema must be an object")
            _check_size(field, json.dumps(schema))
            try:
                return LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
            except ValueError as exc:
                raise StructuredOutputError(field, f"invalid JSON schema: {exc}") from None
        if kind == "regex":
            regex = str(self.regex)
            _check_size(field, regex)
            return LLMatcher.grammar_from_regex(regex)
        if kind == "choice":
            choices = list(self.choice or ())
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError(field, "choice must be a list of non-empty strings")
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            _check_size(field, lark)
            return LLMatcher.grammar_from_lark(lark)
        grammar = str(self.grammar)
        _check_size(field, grammar)
        try:
            lark = any_to_lark(grammar)
        except Exception as exc:  # the GBNF converter raises what its parser meets
            raise StructuredOutputError(field, f"invalid grammar: {exc}") from None
        return LLMatcher.grammar_from_lark(lark)


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _check_size(field: str, text: str) -> None:
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise StructuredOutputError(
            field, f"the {field} is {size} bytes; the limit is {MAX_GRAMMAR_BYTES} bytes"
        )


class GrammarChecker:
    """Checks grammars against the model's tokenizer, each in a thread, each under a deadline.

    A check that outlives its deadline is abandoned (a thread cannot be stopped; llguidance
    drops the GIL while it compiles, so an abandoned one costs a core, never the event loop);
    `limiter` bounds how many run at once.
    """

    def __init__(self, tokenizer: Any, *, timeout: float, max_threads: int = 4) -> None:
        # llguidance.LLTokenizer, or a callable that builds it (in a thread, at first use)
        self._tokenizer = None if callable(tokenizer) else tokenizer
        self._build = tokenizer if callable(tokenizer) else None
        self._build_lock = trio.Lock()
        self.timeout = timeout
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
        from llguidance import LLMatcher

        grammar = constraint.to_grammar()
        async with self._build_lock:
            if self._tokenizer is None and self._build is not None:
                self._tokenizer = await trio.to_thread.run_sync(self._build)
        with trio.move_on_after(self.timeout) as scope:
            is_error, messages = await trio.to_thread.run_sync(
                LLMatcher.validate_grammar_with_warnings,
                grammar,
                self._tokenizer,
                limiter=self._limiter,
                abandon_on_cancel=True,
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


REASONING_PARSERS = ("deepseek_r1", "qwen3")
# The reasoning before a grammar: Lark whose lazy `think` ends at the first </think>, then the
# constrained part (grammar "inner"). deepseek_r1 starts inside the reasoning; qwen3 may open
# an explicit <think> block, or skip it.
_REASONING_LARK = {
    "deepseek_r1": 'start: think SPACE? @inner\nthink[lazy]: TEXT "</think>"\n',
    "qwen3": 'start: (think SPACE?)? @inner\nthink[lazy]: "<think>" TEXT "</think>"\n',
}


def after_reasoning(grammar: str, reasoning_parser: str) -> str:
    """`grammar` (llguidance's JSON form) applied only once the reasoning has ended: the mask
    allows any text until ``</think>``, then holds the output to `grammar`."""
    inner = json.loads(grammar)["grammars"]
    inner[0] = {**inner[0], "name": "inner"}
    lark = _REASONING_LARK[reasoning_parser] + "TEXT: /(.|\\n)*/\nSPACE: /[ \\n]+/\n"
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *inner]})


def build_ll_tokenizer(hf_tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's tokenizer for a Hugging Face fast tokenizer (about a second: build once).

    `vocab_size` is the model's, so a mask covers every logit (padding ids included).
    """
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
