"""OpenAI's response bodies: the pieces completions and chat share, and the one encoder.

Every body is a msgspec Struct in OpenAI's exact shape (checked in the tests with the official
SDK's models), encoded by `encoder`, built once. Here: what every chunk of a response repeats,
the echoed prompt, the SSE framing, both logprobs shapes and the usage; the bodies themselves
are `_completion_bodies` and `_chat_bodies`, streaming's per-response state
`_stream_chunker.StreamChunker`.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import msgspec

from ...engine.client import TokenLogprob
from ..turn._usage import Usage as Usage
from ..turn._usage import usage as usage
from ..turn._usage import usage_of as usage_of


class TokenText(Protocol):
    """A token id's text and bytes, as logprobs show them (`engine.client.TokenPieces`)."""

    def __call__(self, token_id: int) -> str: ...

    def bytes_of(self, token_id: int) -> bytes: ...


SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # vLLM's floor: JSON has no -inf

# -- responses ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every chunk of one response repeats: its id, the model, the creation time."""

    id: str
    model: str
    created: int

    @classmethod
    def completion(cls, model: str) -> ResponseMeta:
        return cls(f"cmpl-{uuid.uuid4().hex}", model, int(time.time()))

    @classmethod
    def chat(cls, model: str) -> ResponseMeta:
        return cls(f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time()))


@dataclasses.dataclass(frozen=True, slots=True)
class EchoPrompt:
    """A completion's prompt, prepended to its text (and logprobs) when `echo` is set."""

    text: str
    token_ids: Sequence[int]


encoder = msgspec.json.Encoder()  # every OpenAI body's, built once


def sse(data: bytes) -> bytes:
    """One server-sent event carrying `data` (a JSON document: it has no newline)."""
    return b"data: " + data + b"\n\n"


# -- logprobs -----------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions' logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed first prompt token has no logprob
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]
    refusal: list[ChatTokenLogprob] | None = None  # OpenAI's: required, null (no refusals)


def completion_logprobs(
    entries: Sequence[tuple[int, TokenLogprob | None]], token_text: TokenText, offset: int
) -> CompletionLogprobs:
    """The sampled token joins its top alternatives, as OpenAI's (up to logprobs + 1)."""
    out = CompletionLogprobs([], [], [], [])
    # The offsets count the text's characters: a character split over tokens counts once,
    # where its last byte arrives (each token's own text would count a U+FFFD per piece).
    characters = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token_id, lp in entries:
        text = token_text(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(characters.decode(token_text.bytes_of(token_id)))
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
        top = {token_text(t): max(v, MIN_LOGPROB) for t, v in lp.top}
        top.setdefault(text, max(lp.logprob, MIN_LOGPROB))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    logprobs: Sequence[TokenLogprob] | None, token_text: TokenText
) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    content = []
    for lp in logprobs:
        token, raw = token_text(lp.token_id), list(token_text.bytes_of(lp.token_id))
        top = [_top_logprob(token_text, t, v) for t, v in lp.top]
        content.append(ChatTokenLogprob(token, max(lp.logprob, MIN_LOGPROB), raw, top))
    return ChatLogprobs(content)


def _top_logprob(token_text: TokenText, token_id: int, logprob: float) -> TopLogprob:
    raw = list(token_text.bytes_of(token_id))
    return TopLogprob(token_text(token_id), max(logprob, MIN_LOGPROB), raw)
