"""The Messages API's request bodies as msgspec schemas (Anthropic's field names).

Only the fields Anthropic defines: each is translated (`anthropic/_api.chat_request`), accepted
for a stated reason (its comment says why), or refused there with a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


class Block(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A content block as sent; its `type` says which of the other fields it uses."""

    type: str
    text: str | None = None  # text
    citations: Any = None  # text: refused (nothing here cites)
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    cache_control: Any = None  # accepted: every prefix is cached anyway


class Message(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    role: str
    content: str | list[Block]


class ToolSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A tool as sent: a custom one (no `type`, or "custom"), or one of Anthropic's."""

    name: str | None = None
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None  # accepted: a call streams whole anyway
    cache_control: Any = None


class ToolChoiceSpec(msgspec.Struct, kw_only=True, frozen=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True, frozen=True):
    type: str
    budget_tokens: int | None = None
    display: str | None = None


class Metadata(msgspec.Struct, kw_only=True, frozen=True):
    user_id: str | None = None


class OutputFormat(msgspec.Struct, kw_only=True, frozen=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, kw_only=True, frozen=True):
    effort: str | None = None
    format: OutputFormat | None = None


class Conversation(msgspec.Struct, kw_only=True):
    """The fields a reply and a token count share: the conversation and its tools."""

    model: str
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[Block] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: Any = None  # accepted: every prefix is cached anyway
    workspace_id: str | None = None  # accepted, unused: no accounts here
    user_profile_id: str | None = None
    container: Any = None  # REFUSED and ALLOWED from here
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: str | None = None
    service_tier: str | None = None


class MessagesRequest(Conversation, kw_only=True):
    """`POST /v1/messages`."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: Metadata | None = None


class CountTokensRequest(Conversation, kw_only=True):
    """`POST /v1/messages/count_tokens`: the conversation, without sampling."""
