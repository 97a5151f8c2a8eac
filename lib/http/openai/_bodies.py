"""OpenAI's response bodies as msgspec Structs encoded by one encoder, in OpenAI's exact
shapes (checked in the tests with the official SDK's models), plus vLLM's `stop_reason` on
each choice. Streaming's per-response state is `_stream_chunker.StreamChunker`.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from ...engine.client import Output, TokenLogprob
from ..turn._chat_output import ChatOutputParser, ChatParts
from ..turn._usage import Usage as Usage
from ..turn._usage import usage as usage
from ..turn._usage import usage_of as usage_of
from ._vllm_extras import Extras, PromptLogprobs, add_chat_extras, add_completion_extras


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


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions' logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed first prompt token has no logprob
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


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


class ToolCallFunctionOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(msgspec.Struct):
    id: str
    function: ToolCallFunctionOut
    type: str = "function"


class ChatResponseMessage(msgspec.Struct):
    content: str | None
    refusal: str | None = None  # OpenAI's: required, null (this server never refuses)
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET  # the older name of `reasoning`


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's, when asked


class ChatDelta(msgspec.Struct):
    role: str | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's, when asked


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    # vLLM's, when asked (`_vllm_extras`)
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET  # null until the usage chunk
    object: str = "chat.completion.chunk"
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's: first chunk


_encoder = msgspec.json.Encoder()


def sse(data: bytes) -> bytes:
    """One server-sent event carrying `data` (a JSON document: it has no newline)."""
    return b"data: " + data + b"\n\n"


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
    return _encoder.encode(body)


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
    return _encoder.encode(Completion(meta.id, meta.created, meta.model, [choice], usage_field))


def completion_usage_chunk(meta: ResponseMeta, usage: Usage) -> bytes:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return _encoder.encode(Completion(meta.id, meta.created, meta.model, [], usage))


def chat_completion_response(
    meta: ResponseMeta,
    outputs: Sequence[Output],
    *,
    n: int,
    token_text: TokenText,
    parser: Callable[[], ChatOutputParser] | None = None,
    prompt_tokens_details: bool = False,
    extras: Extras | None = None,
) -> bytes:
    """A `chat.completion`: one assistant message per output (index `output.index`);
    `parser` makes each choice's reasoning / tool-call parser, when the request needs one;
    the usage reports the prefix-cache hits with `prompt_tokens_details`; `extras` are
    vLLM's fields the request asked for (`_vllm_extras`)."""
    choices = []
    for o in outputs:
        message, finish = ChatResponseMessage(o.text), o.finish_reason
        if parser is not None:
            message, finish = _parsed_message(parser(), o)
        choices.append(
            ChatChoice(
                o.index, message, _chat_logprobs(o.logprobs, token_text), finish, o.stop_reason
            )
        )
    used = usage_of(outputs, n=n, prompt_tokens_details=prompt_tokens_details)
    body = ChatCompletion(meta.id, meta.created, meta.model, choices, used)
    if extras is not None:
        add_chat_extras(body, outputs, extras, n, token_text)
    return _encoder.encode(body)


def chat_completion_chunk(
    meta: ResponseMeta,
    output: Output,
    *,
    token_text: TokenText,
    first: bool = False,
    include_usage: bool = False,
    parts: ChatParts | None = None,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    usage: Usage | None = None,
) -> bytes:
    """One `chat.completion.chunk` with the new text of one choice.

    Args:
        first: the choice's first chunk: its delta carries `role: "assistant"` and `content`
            even if empty (OpenAI's first chunk is `{"role": "assistant", "content": ""}`).
            Later deltas without text are `{}`.
        include_usage: the stream ends with a usage chunk, so this one says `"usage": null`.
        token_ids, prompt_token_ids, usage: vLLM's, when asked: the new token ids, the
            prompt's (the first chunk), the choice's usage so far.
    """
    content = output.text if parts is None else parts.content
    delta = ChatDelta(
        role="assistant" if first else msgspec.UNSET,
        content=content if content or first else msgspec.UNSET,
    )
    if parts is not None:
        if parts.tool_calls:
            delta.tool_calls = parts.tool_calls
        if parts.reasoning:
            delta.reasoning = delta.reasoning_content = parts.reasoning
    choice = ChatChunkChoice(
        output.index,
        delta,
        _chat_logprobs(output.logprobs, token_text),
        finish_reason or output.finish_reason,
        output.stop_reason,
    )
    usage_field: Usage | msgspec.UnsetType | None = None if include_usage else msgspec.UNSET
    if usage is not None:
        usage_field = usage
    body = ChatCompletionChunk(meta.id, meta.created, meta.model, [choice], usage_field)
    if token_ids is not None:
        choice.token_ids = token_ids
    if prompt_token_ids is not None:
        body.prompt_token_ids = prompt_token_ids
    return _encoder.encode(body)


def chat_usage_chunk(meta: ResponseMeta, usage: Usage) -> bytes:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return _encoder.encode(ChatCompletionChunk(meta.id, meta.created, meta.model, [], usage))


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
        _completion_logprobs(entries, token_text, offset) if asked else None,
        output.finish_reason,
        output.stop_reason,
    )


def _completion_logprobs(
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


def _chat_logprobs(
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


def _parsed_message(
    parser: ChatOutputParser, output: Output
) -> tuple[ChatResponseMessage, str | None]:
    parts = parser.feed(output.text)
    parts.add(parser.finish(cut=output.finish_reason == "length"))
    calls = [ToolCallOut(c.id, ToolCallFunctionOut(c.name, c.arguments)) for c in parser.tool_calls]
    message = ChatResponseMessage(parts.content.strip() if calls else parts.content)
    if calls:
        message.tool_calls = calls
        message.content = message.content or None
    if parts.reasoning:
        message.reasoning = message.reasoning_content = parts.reasoning
    return message, tool_calls_finish(output.finish_reason, bool(calls))


def tool_calls_finish(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" when a finished choice called a tool."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason
