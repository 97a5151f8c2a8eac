"""`StructuredCheck`: a request's constraint and thinking budget as one checked grammar.

`AsyncLLM.prepare` runs it so that a bad constraint, or a thinking budget on a server with
no reasoning parser, is refused before a response starts. The constraint's own check is the
`GrammarChecker`'s (`_structured`), built at the first constraint (llguidance's tokenizer
is costly, and a server may never see one), then kept with its cache of checked grammars.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._grammar_budget import GrammarBudget
from ._sampling_params import SamplingParams
from ._structured import (
    GrammarChecker,
    StructuredOutputError,
    after_reasoning,
    build_ll_tokenizer,
    free_text,
)


class StructuredCheck:
    """Checks requests' grammars against the model read from `vocabulary`: a callable that
    gives (tokenizer, vocab_size) once both are known (at the first constraint)."""

    def __init__(
        self,
        vocabulary: Callable[[], tuple[Any, int]],
        *,
        reasoning_parser: str | None,
        timeout: float,
        budget: GrammarBudget,
    ) -> None:
        self._vocabulary = vocabulary
        self.reasoning_parser = reasoning_parser
        self.timeout = timeout  # LLMConfig.engine.structured_outputs_timeout
        self.budget = budget
        self.checker: GrammarChecker | None = None  # built at the first constraint

    async def check(self, params: SamplingParams) -> str:
        """The checked grammar of `params.structured_outputs` ("" for none), after the
        reasoning when the server runs a reasoning parser (a grammar is checked once, then
        cached).

        Raises:
            StructuredOutputError: invalid, too large, or not checked in time; or a
                `thinking_token_budget` with no reasoning parser.
        """
        budget, parser = params.thinking_token_budget, self.reasoning_parser
        if budget is not None and parser is None:
            raise StructuredOutputError(
                "thinking_token_budget",
                "thinking_token_budget needs a reasoning model: this server runs no reasoning "
                "parser (start it with --reasoning-parser), so it has no thinking to bound",
            )
        if params.structured_outputs is None:
            return (
                ""
                if budget is None or parser is None
                else after_reasoning(free_text(parser), parser, budget)
            )
        if self.checker is None:
            tokenizer, vocab = self._vocabulary()
            self.checker = GrammarChecker(
                lambda: build_ll_tokenizer(tokenizer, vocab),
                timeout=self.timeout,
                budget=self.budget,
            )
        grammar = await self.checker.check(params.structured_outputs)
        if parser is not None:
            grammar = after_reasoning(grammar, parser, budget)
        return grammar
