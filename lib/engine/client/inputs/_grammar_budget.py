"""Depth and size budgets for a request's constraint, measured before llguidance sees it.

Why: llguidance compiles a grammar by recursion, a few KiB of native stack per step of a
chain (a rule naming the next rule, a `$ref` naming the next definition, a schema nested in
a schema), and a chain long enough overflows its thread's stack: a SIGSEGV, which ends the
whole process, not an error (issue 25: 3,000 chained rules or `$ref`s in a 200 KB request
killed the API server; llama.cpp capped the same crash). So a constraint is measured here
first, by iterative code that no input can overflow, against two limits:

- `max_bytes` (`--structured-outputs-max-bytes`, 256 KiB): the schema or grammar's size;
- `max_depth` (`--structured-outputs-max-depth`, 512): the most steps one path through it
  takes (`_depth`): for a JSON schema, the JSON objects on one path from the root, a `$ref`
  followed into the object it names; for a Lark or GBNF grammar, the rules and terminals on
  one chain of references, an inline `%json` schema adding its own depth.

One depth for all: they spend the same stack, and separate limits on nesting and on `$ref`
chains would not bound a chain of `$ref`s whose definitions each nest. Measured on
llguidance 1.9 with an 8 MiB stack (what the engine's compile threads have), the shallowest
crash found is 1,777 deep in these units (a chain of 887 `prefixItems` `$ref`s; `anyOf`:
2,115, `properties`: 2,802, rules: 2,705), so the default keeps 3.4x away from it, and the
real schemas and grammars of the tests and benchmarks measure at most 29 (JSON Schema's
draft-07 meta-schema; `tests/engine/client/test_grammar_budget.py`). Regexes need no depth
limit: llguidance's own parser refuses deep nesting (100,000 groups in 0.2 s). The
frontend's check runs on a thread with `stack_bytes` of stack (256 MiB at the default size:
at least twice what the deepest 256 KiB grammar we could build needs), so what the budget
admits, even raised, does not overflow it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._depth import gbnf_depth, lark_depth, schema_depth
from ._regex_size import (
    MAX_REGEX_OPTIONALS,
    lark_regex_optionals,
    regex_optionals,
    schema_regex_optionals,
)

MAX_GRAMMAR_BYTES = 256 * 1024  # the default size limit of a schema or grammar
MAX_STRUCTURED_DEPTH = 512  # the default depth limit (units in the module docstring)
# The check thread's stack per byte a constraint may have: the deepest 256 KiB grammar found
# (a chain of 23,087 one-line rules) needed between 64 and 128 MiB.
STACK_PER_BYTE = 1024
MIN_STACK_BYTES = 64 << 20


class GrammarBudgetError(ValueError):
    """A constraint is over a budget; the message names the value, the limit and its flag.

    Attributes:
        value: what was measured (bytes, or depth).
        limit: the limit it passed.
    """

    def __init__(self, message: str, *, value: int, limit: int) -> None:
        super().__init__(message)
        self.value = value
        self.limit = limit


@dataclass(frozen=True)
class GrammarBudget:
    """How large and how deep a constraint may be (the server's `--structured-outputs-max-*`)."""

    max_depth: int = MAX_STRUCTURED_DEPTH
    max_bytes: int = MAX_GRAMMAR_BYTES
    max_regex_optionals: int = MAX_REGEX_OPTIONALS

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise ValueError(f"--structured-outputs-max-depth must be >= 1, got {self.max_depth}")
        if self.max_bytes < 1:
            raise ValueError(f"--structured-outputs-max-bytes must be >= 1, got {self.max_bytes}")
        if self.max_regex_optionals < 1:
            raise ValueError(
                "--structured-outputs-max-regex-optionals must be >= 1, "
                f"got {self.max_regex_optionals}"
            )

    @property
    def stack_bytes(self) -> int:
        """The stack of the thread that checks a constraint: enough for any of `max_bytes`."""
        wanted = max(MIN_STACK_BYTES, STACK_PER_BYTE * self.max_bytes)
        return -(-wanted // (1 << 20)) << 20  # whole MiB: threading.stack_size wants pages

    def check_size(self, text: str) -> None:
        """Raises `GrammarBudgetError` if `text` is over `max_bytes` (UTF-8)."""
        size = len(text.encode())
        if size > self.max_bytes:
            raise GrammarBudgetError(
                f"is {size} bytes; the limit is {self.max_bytes} bytes "
                f"(--structured-outputs-max-bytes)",
                value=size,
                limit=self.max_bytes,
            )

    def check_schema(self, schema: object) -> None:
        """Raises `GrammarBudgetError` if the JSON schema nests deeper than `max_depth`."""
        self._check_depth(schema_depth(schema), "JSON objects on one path, each $ref followed")

    def check_lark(self, grammar: str) -> None:
        """Raises `GrammarBudgetError` if the Lark grammar is deeper than `max_depth` (its size
        is checked apart, on the text the client sent)."""
        what = "rules on one chain of references, an inline %json adding its depth"
        self._check_depth(lark_depth(grammar), what)

    def check_gbnf(self, grammar: str) -> None:
        """Raises `GrammarBudgetError` if the GBNF grammar is deeper than `max_depth` (checked
        before the converter to Lark, whose time grows with the square of a chain)."""
        self._check_depth(gbnf_depth(grammar), "rules on one chain of references")

    def check_regex(self, regex: str) -> None:
        """Raises `GrammarBudgetError` if the regex has more than `max_regex_optionals`
        optional items (`?`, `*`: `_regex_size`)."""
        self._check_optionals(regex_optionals(regex), "regex")

    def check_schema_patterns(self, schema: object) -> None:
        """Raises `GrammarBudgetError` if one `pattern` of the JSON schema has more than
        `max_regex_optionals` optional items."""
        self._check_optionals(schema_regex_optionals(schema), "pattern")

    def check_lark_lexemes(self, grammar: str) -> None:
        """Raises `GrammarBudgetError` if one lexeme of the Lark grammar (a regex, a terminal
        with the terminals it names inlined) has more than `max_regex_optionals` optional
        items. Check the depth first: it bounds the cost of inlining."""
        limit = self.max_regex_optionals
        self._check_optionals(lark_regex_optionals(grammar, limit), "regex or terminal")

    def _check_optionals(self, count: int, what: str) -> None:
        if count > self.max_regex_optionals:
            raise GrammarBudgetError(
                f"has more than {self.max_regex_optionals} optional items (? or *) in one "
                f"{what}, the limit "
                f"(--structured-outputs-max-regex-optionals); use a counted repeat such as "
                f"a{{0,N}} instead",
                value=count,
                limit=self.max_regex_optionals,
            )

    def _check_depth(self, depth: int, what: str) -> None:
        if depth > self.max_depth:
            raise GrammarBudgetError(
                f"nests {depth} deep ({what}); the limit is {self.max_depth} "
                f"(--structured-outputs-max-depth)",
                value=depth,
                limit=self.max_depth,
            )
