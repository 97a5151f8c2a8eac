"""The legacy completions' bodies (`text_completion`): the whole response and its chunks.

In OpenAI's exact shape, plus vLLM's `stop_reason` on each choice and vLLM's fields when asked
(`_vllm_extras`); encoded by `_bodies.encoder`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ...engine.client import Output, TokenLogprob
from ..turn._usage import Usage, usage_of
from ._bodies import (
    CompletionLogprobs,
    EchoPrompt,
    ResponseMeta,
    TokenText,
    completion_logprobs,
    encoder,
)
from ._vllm_extras import Extras, PromptLogprobs, add_completion_extras


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    # vLLM's, when asked (`_vllm_extras`)
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET
    object: str = "text_completion"  # chunks too, as OpenAI


def completion_response(
    meta: ResponseMeta,
    outputs: Sequence[Output],
    *,
    n: int,
    token_text: TokenText,
    echo: Sequence[EchoPrompt] | None = None,
    prompt_tokens_details: bool = False,
    extras: Extras | None = None,
) -> bytes:
    """A `text_completion`: one choice per output (index `output.index`), and the usage.

    Args:
        outputs: every choice's merged output; for a batch of prompts, renumbered so that
            choice `i` is of prompt `i // n`.
        n: choices per prompt.
        echo: the prompts (in batch order), to prepend when the request set `echo`.
        prompt_tokens_details: report the prefix-cache hits (`cached_tokens`).
        extras: vLLM's fields the request asked for (`_vllm_extras`).
    """
    choices = [
        _completion_choice(o, token_text, echo[o.index // n] if echo else None, 0) for o in outputs
    ]
    if extras is not None:
        add_completion_extras(choices, outputs, extras, n, token_text)
    used = usage_of(outputs, n=n, prompt_tokens_details=prompt_tokens_details)
    body = Completion(meta.id, meta.created, meta.model, choices, used)
    return encoder.encode(body)


def completion_chunk(
    meta: ResponseMeta,
    output: Output,
    *,
    token_text: TokenText,
    text_offset: int = 0,
    echo: EchoPrompt | None = None,
    include_usage: bool = False,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    usage: Usage | None = None,
) -> bytes:
    """One streamed `text_completion` chunk with the new text of one choice.

    Args:
        text_offset: the length of the choice's text streamed so far (logprobs' offsets
            continue from it).
        echo: the prompt, on the choice's first chunk only, when the request set `echo`.
        include_usage: the stream ends with a usage chunk, so this one says `"usage": null`.
        token_ids, prompt_token_ids, usage: vLLM's, when asked: the new token ids, the
            prompt's (a choice's first chunk), the choice's usage so far.
    """
    choice = _completion_choice(output, token_text, echo, text_offset)
    if token_ids is not None:
        choice.token_ids = token_ids
    if prompt_token_ids is not None:
        choice.prompt_token_ids = prompt_token_ids
    usage_field: Usage | msgspec.UnsetType | None = None if include_usage else msgspec.UNSET
    if usage is not None:
        usage_field = usage
    return encoder.encode(Completion(meta.id, meta.created, meta.model, [choice], usage_field))


def completion_usage_chunk(meta: ResponseMeta, usage: Usage) -> bytes:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return encoder.encode(Completion(meta.id, meta.created, meta.model, [], usage))


def _completion_choice(
    output: Output, token_text: TokenText, echo: EchoPrompt | None, offset: int
) -> CompletionChoice:
    entries: list[tuple[int, TokenLogprob | None]] = []
    if echo is not None and output.prompt_logprobs is not None:
        prompt_lps = output.prompt_logprobs
        entries = [
            (t, prompt_lps[i] if i < len(prompt_lps) else None)
            for i, t in enumerate(echo.token_ids)
        ]
    if output.logprobs is not None:
        entries += [(lp.token_id, lp) for lp in output.logprobs]
    asked = output.logprobs is not None or bool(echo and output.prompt_logprobs)
    return CompletionChoice(
        output.index,
        (echo.text if echo is not None else "") + output.text,
        completion_logprobs(entries, token_text, offset) if asked else None,
        output.finish_reason,
        output.stop_reason,
    )
