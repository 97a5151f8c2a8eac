"""What `LLM.generate` and `LLM.embed` return, shaped like vLLM's `RequestOutput` /
`CompletionOutput` / `EmbeddingRequestOutput`, so code written against `vllm.LLM` reads
trillm's results unchanged.

Logprobs follow vLLM: per generated token, a dict from token id to `Logprob` (the sampled
token first, then the top alternatives), `rank` 1 for the best; `cumulative_logprob` is the
sum over the sampled tokens, None unless logprobs were asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._outputs import Output, TokenLogprob

SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]  # None for the first prompt token


@dataclass(slots=True)
class Logprob:
    """One token's log probability, its rank among the alternatives (None: not among the
    top ones returned) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (`index` of `n`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result: its completions in index order."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (cut to `dimensions` and normalised as asked), vLLM's shape."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's: `outputs.embedding` is the vector."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def completion_output(output: Output, decode: Callable[[int], str]) -> CompletionOutput:
    """A child's whole `Output` (every step merged) as vLLM shapes it."""
    logprobs = None if output.logprobs is None else [_entry(t, decode) for t in output.logprobs]
    cumulative = None if output.logprobs is None else sum(t.logprob for t in output.logprobs)
    return CompletionOutput(
        output.index,
        output.text,
        output.token_ids,
        cumulative,
        logprobs,
        output.finish_reason,
        output.stop_reason,
    )


def prompt_logprobs(output: Output, decode: Callable[[int], str]) -> PromptLogprobs | None:
    if output.prompt_logprobs is None:
        return None
    return [None if t is None else _entry(t, decode) for t in output.prompt_logprobs]


def _entry(token: TokenLogprob, decode: Callable[[int], str]) -> dict[int, Logprob]:
    ranks = {token_id: rank for rank, (token_id, _) in enumerate(token.top, 1)}
    entry = {
        token.token_id: Logprob(token.logprob, ranks.get(token.token_id), decode(token.token_id))
    }
    for rank, (token_id, logprob) in enumerate(token.top, 1):
        if token_id not in entry:
            entry[token_id] = Logprob(logprob, rank, decode(token_id))
    return entry
