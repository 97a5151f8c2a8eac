"""The chat completions' bodies (`chat.completion`, `chat.completion.chunk`): messages, deltas.

In OpenAI's exact shape, plus vLLM's `stop_reason` on each choice and vLLM's fields when asked
(`_vllm_extras`); a choice's reasoning and tool calls come from its parser
(`turn/_chat_output`). Encoded by `_bodies.encoder`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ...engine.client import Output
from ..turn._chat_output import ChatOutputParser, ChatParts
from ..turn._usage import Usage, usage_of
from ._bodies import ChatLogprobs, ResponseMeta, TokenText, chat_logprobs, encoder
from ._vllm_extras import Extras, PromptLogprobs, add_chat_extras


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
                o.index, message, chat_logprobs(o.logprobs, token_text), finish, o.stop_reason
            )
        )
    used = usage_of(outputs, n=n, prompt_tokens_details=prompt_tokens_details)
    body = ChatCompletion(meta.id, meta.created, meta.model, choices, used)
    if extras is not None:
        add_chat_extras(body, outputs, extras, n, token_text)
    return encoder.encode(body)


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
        chat_logprobs(output.logprobs, token_text),
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
    return encoder.encode(body)


def chat_usage_chunk(meta: ResponseMeta, usage: Usage) -> bytes:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return encoder.encode(ChatCompletionChunk(meta.id, meta.created, meta.model, [], usage))


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
