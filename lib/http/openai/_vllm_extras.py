"""vLLM's additions to the completions and chat responses, which clients written against vLLM
read: the prompt's logprobs, the prompt's and each choice's token ids, chat's echo of a final
assistant message, and the usage on every streamed chunk.

Shapes are vLLM's (`vllm/entrypoints/openai/protocol.py`): `prompt_logprobs` is a list with
one entry per prompt token, None for the first (nothing precedes it), else a dict from token
id (a JSON key: a string) to `{logprob, rank, decoded_token}` holding the prompt's own token
and the top alternatives; completions put it and `prompt_token_ids` on each choice, chat at
the top of the response; `token_ids` are a choice's generated tokens (a chunk's new ones).
Each is left out of the body unless the request asked for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from ...engine.client import Output, PreparedRequest, TokenLogprob
from ..turn._usage import Usage, usage

if TYPE_CHECKING:  # (`_chat_bodies` and `_completion_bodies` import this module)
    from ._chat_bodies import ChatCompletion
    from ._completion_bodies import CompletionChoice

LOGPROB_FLOOR = -9999.0  # vLLM's floor, as `openai/_bodies.MIN_LOGPROB`: JSON has no -inf


class PromptLogprob(msgspec.Struct):
    """vLLM's `Logprob`: `rank` 1 is the best; None for a prompt token outside the top
    alternatives returned (the engine ranks only those)."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]


@dataclass(frozen=True, slots=True)
class Extras:
    """What one request asked vLLM's extras for.

    Attributes:
        return_token_ids: add `prompt_token_ids` and each choice's `token_ids`.
        prompt_logprobs: add `prompt_logprobs`.
        prompt_token_ids: each prompt's token ids, in batch order.
        echo: chat: the text every choice's content starts with (the final assistant
            message, with `echo`); "" for none.
        continuous_usage: a stream's every chunk carries its choice's usage so far.
    """

    return_token_ids: bool = False
    prompt_logprobs: bool = False
    prompt_token_ids: Sequence[Sequence[int]] = ()
    echo: str = ""
    continuous_usage: bool = False

    @classmethod
    def of(cls, request: Any, prepared: Sequence[PreparedRequest]) -> Extras:
        """The extras `request` (completions or chat) asks for, its prompts `prepared`."""
        echo = ""
        messages = getattr(request, "messages", None)
        # vLLM's echo: the final message, when it is the role of the reply (the assistant's);
        # after a user's message there is nothing of the reply's to repeat, and none is
        if messages is not None and request.echo and messages[-1].role == "assistant":
            echo = messages[-1].text
        return cls(
            return_token_ids=bool(request.return_token_ids),
            prompt_logprobs=request.prompt_logprobs is not None,
            prompt_token_ids=[p.token_ids for p in prepared],
            echo=echo,
            continuous_usage=request.continuous_usage,
        )

    def prompt_ids(self, choice_index: int, n: int) -> list[int] | msgspec.UnsetType:
        """The prompt token ids of choice `choice_index` (n choices a prompt), if asked."""
        if not self.return_token_ids:
            return msgspec.UNSET
        return list(self.prompt_token_ids[choice_index // n])

    def token_ids(self, output: Output) -> list[int] | msgspec.UnsetType:
        """`output`'s generated token ids, if asked."""
        return list(output.token_ids) if self.return_token_ids else msgspec.UNSET


def add_completion_extras(
    choices: Sequence[CompletionChoice],
    outputs: Sequence[Output],
    extras: Extras,
    n: int,
    token_text: Any,
) -> None:
    """Put what `extras` asks for on a completions response's choices (one per output)."""
    prompt_lps = prompt_logprobs_of(outputs, n, token_text) if extras.prompt_logprobs else {}
    for choice, output in zip(choices, outputs, strict=True):
        choice.prompt_token_ids = extras.prompt_ids(output.index, n)
        choice.token_ids = extras.token_ids(output)
        if extras.prompt_logprobs:
            choice.prompt_logprobs = prompt_lps.get(output.index // n, [])


def add_chat_extras(
    body: ChatCompletion, outputs: Sequence[Output], extras: Extras, n: int, token_text: Any
) -> None:
    """Put what `extras` asks for on a chat response (one choice per output)."""
    for choice, output in zip(body.choices, outputs, strict=True):
        choice.token_ids = extras.token_ids(output)
        if extras.echo:
            choice.message.content = extras.echo + (choice.message.content or "")
    body.prompt_token_ids = extras.prompt_ids(0, n)
    if extras.prompt_logprobs:
        body.prompt_logprobs = prompt_logprobs_of(outputs, n, token_text).get(0, [])


def prompt_logprobs_of(
    outputs: Sequence[Output], n: int, token_text: Any
) -> dict[int, PromptLogprobs]:
    """Each prompt's logprobs (by its index in the batch) in vLLM's shape, from the first of
    its choices that carries them; `token_text` shows a token (`openai/_bodies.TokenText`)."""
    out: dict[int, PromptLogprobs] = {}
    for output in sorted(outputs, key=lambda o: o.index):
        if output.prompt_logprobs is not None and output.index // n not in out:
            out[output.index // n] = shaped(output.prompt_logprobs, token_text)
    return out


def shaped(entries: Sequence[TokenLogprob | None], token_text: Any) -> PromptLogprobs:
    """Prompt logprobs as vLLM's response shows them: the prompt's own token first."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(entry.top, 1)}
        position = {entry.token_id: _logprob(entry.token_id, entry.logprob, ranks, token_text)}
        for token_id, logprob in entry.top:
            if token_id not in position:
                position[token_id] = _logprob(token_id, logprob, ranks, token_text)
        out.append(position)
    return out


def chunk_usage(output: Output | None) -> Usage:
    """A choice's usage so far, as vLLM's `continuous_usage_stats` puts it on each chunk."""
    if output is None:
        return usage(0, 0)
    return usage(output.num_prompt_tokens, output.num_output_tokens)


def _logprob(
    token_id: int, logprob: float, ranks: dict[int, int], token_text: Any
) -> PromptLogprob:
    return PromptLogprob(max(logprob, LOGPROB_FLOOR), ranks.get(token_id), token_text(token_id))
