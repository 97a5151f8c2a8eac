"""OpenAI's `usage` record: tokens in, tokens out, and (when asked) the cached prompt tokens."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from ...engine.client import Output


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # absent unless the server runs with --enable-prompt-tokens-details (OpenAI's schema has
    # an object or no field; vLLM's null fails it): cached_tokens tells a client how much
    # of its prompt another request sent before.
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    """The usage record; `prompt_tokens_details` only when `cached_tokens` is given."""
    total = prompt_tokens + completion_tokens
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens)
    return Usage(prompt_tokens, completion_tokens, total, details)


def usage_of(outputs: Iterable[Output], *, n: int, prompt_tokens_details: bool = False) -> Usage:
    """The usage of the (last) outputs of every choice; choice i is of prompt i // n.

    A prompt counts once however many choices it has, as OpenAI counts it; its cached
    tokens are those of its first choice, reported only with `prompt_tokens_details`.
    """
    prompts: dict[int, Output] = {}
    completion_tokens = 0
    for output in outputs:
        completion_tokens += output.num_output_tokens
        first = prompts.setdefault(output.index // n, output)
        if output.index < first.index:
            prompts[output.index // n] = output
    prompt_tokens = sum(o.num_prompt_tokens for o in prompts.values())
    cached = sum(o.num_cached_tokens for o in prompts.values())
    return usage(prompt_tokens, completion_tokens, cached if prompt_tokens_details else None)
