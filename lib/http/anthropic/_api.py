"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) onto chat.

A request becomes a chat request (`chat_request`), so one chat template, one grammar, one
tool parser and one reasoning parser serve every API (`Generation.plan_chat`); the reply's
wire shape (content blocks, the SSE events, Anthropic's error body) is `anthropic/_stream`.

- `system` (a string or text blocks) is the first, system message; a message of role
  `system` is one too.
- A user turn's `tool_result` blocks become one `tool` message each, in order
  (`tool_call_id` = `tool_use_id`; `is_error` prefixes the content with "Error: "), then
  its text blocks one user message. An assistant turn's `tool_use` blocks are its
  `tool_calls`, its text blocks its content, its `thinking` blocks its `reasoning_content`.
  `redacted_thinking` blocks are dropped: their data is Anthropic's encryption, which no
  model here can read.
- `tools` are functions (`input_schema` their parameters; `input_examples` appended to the
  description); `tool_choice` `auto`/`any`/`tool`/`none` is chat's `auto`/`required`/named/
  `none`, and `disable_parallel_tool_use` is `parallel_tool_calls=false`.
- `stop_sequences` is `stop`, `metadata.user_id` is `user`, `output_config.format` (a JSON
  schema) is `response_format`; `max_tokens`, `temperature`, `top_p`, `top_k` keep their names.
- `thinking` (`enabled` with `budget_tokens` of at least 1024 and under `max_tokens`, or
  `adaptive`): the model's reasoning shows as `thinking` blocks when the server runs a
  `--reasoning-parser` (`check_thinking` refuses `enabled` otherwise). `budget_tokens` is
  vLLM's `thinking_token_budget`: after that many tokens of thought the grammar closes the
  reasoning. `disabled` turns off nothing: a reasoning model's reasoning still shows as
  thinking blocks, as the server's parser splits every turn.
- `cache_control` (on the request, a block or a tool) is accepted: trillm caches every
  prompt prefix by itself. `workspace_id` and `user_profile_id` are accepted and unused
  (attribution to Anthropic's accounts; this server has none).

What the server cannot do is a 400 naming the field, never ignored: image, document and the
other block types, server tools (`web_search_*`, `bash_*`, `text_editor_*`, `computer_*`, ...),
`container`, `mcp_servers`, `context_management`, `diagnostics`, `inference_geo`, `speed: fast`,
priority `service_tier`s, citations, `output_config.effort`, `thinking.display: omitted`,
`defer_loading`, callers other than `direct`, and a prefill (a last message from the
assistant: the chat template opens a new turn; Anthropic answers models without prefill so).
Fields Anthropic does not define are ignored, as everywhere in the server.
"""

from __future__ import annotations

import json
from typing import Any

from ..edge._admission import Held
from ..edge._errors import fields_renamed
from ..openai._requests import ChatCompletionRequest, ChatMessage, MessageToolCall, ToolCallFunction
from ..turn._constraints import (
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolChoice,
)
from ..turn._generate import Generation
from ..turn._turn_runner import run_turn
from ._checks import (
    bad,
    check_thinking,
    check_thinking_config,
    refuse_unsupported,
    unsupported_block,
)
from ._schema import (
    Block,
    CountTokensRequest,
    Message,
    MessagesRequest,
    OutputConfig,
    ToolChoiceSpec,
    ToolSpec,
)
from ._stream import MessagesFace as MessagesFace
from ._stream import anthropic_error_body as anthropic_error_body
from ._stream import count_tokens_response as count_tokens_response

# Chat's field names in errors raised past the translation, as this API calls them.
MESSAGES_RENAMES = {
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "thinking_token_budget": "thinking.budget_tokens",
}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": named


class MessagesAPI:
    """The routes' handlers: translate, plan, run (`POST /v1/messages`), or count."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def create(
        self,
        request: MessagesRequest,
        held: Held,
        receive: Any,
        send: Any,
        extra: list[Any],
        *,
        rank: int | None = None,
    ) -> None:
        """Answer `request` with a message, whole or streamed as Anthropic's events, on
        engine `rank` when its header pinned one."""
        check_thinking(request, self.generation.llm.config.reasoning_parser)
        with fields_renamed(MESSAGES_RENAMES):
            chat = chat_request(request)
            chat.data_parallel_rank = rank  # the engine its header pinned (`Edge.rank`)
            plan = await self.generation.plan_chat(chat, held)
        details = self.generation.config.enable_prompt_tokens_details
        await run_turn(
            self.generation,
            plan,
            MessagesFace(request.model, cached_details=details),
            stream=bool(request.stream),
            receive=receive,
            send=send,
            extra=extra,
        )

    async def count_tokens(self, request: CountTokensRequest) -> bytes:
        """The body of `/v1/messages/count_tokens`: the prompt's length, tools included."""
        check_thinking(request, self.generation.llm.config.reasoning_parser)
        with fields_renamed(MESSAGES_RENAMES):
            tokens = await self.generation.chat_tokens(chat_request(request))
        return count_tokens_response(len(tokens))


def chat_request(request: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request `request` stands for.

    Raises:
        RequestError: 400 naming the field (in Anthropic's terms) the server cannot serve.
    """
    refuse_unsupported(request)
    check_thinking_config(request)
    messages = _system_messages(request.system, "system")
    for i, message in enumerate(request.messages):
        messages += _chat_messages(message, f"messages[{i}]")
    last = len(request.messages) - 1
    if request.messages[last].role == "assistant":
        raise bad(
            f"messages[{last}].role",
            "the last message is the assistant's (a prefill), which this server does not "
            "continue: end the conversation with a user message",
        )
    choice, parallel = _tool_choice(request.tool_choice)
    fields: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        metadata = request.metadata
        fields = {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "user": metadata.user_id if metadata is not None else None,
        }
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled":  # at most its budget, then answer
        fields["thinking_token_budget"] = thinking.budget_tokens
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        tools=[_tool(t, f"tools[{i}]") for i, t in enumerate(request.tools)]
        if request.tools
        else None,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=_response_format(request.output_config),
        **fields,
    )


# -- the parts ------------------------------------------------------------------------------


def _text_of(blocks: list[Block], where: str) -> str:
    """Text blocks' text, joined by newlines; any other kind is a 400 naming its type."""
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise unsupported_block(block, f"{where}[{j}]", "'text'")
        texts.append(_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _text(block: Block, where: str) -> str:
    if block.citations is not None:
        raise bad(f"{where}.citations", "citations are not supported; leave them out")
    if block.text is None:
        raise bad(f"{where}.text", "required in a 'text' block")
    return block.text


def _system_messages(system: str | list[Block] | None, where: str) -> list[ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _text_of(system, where)
    return [ChatMessage("system", text)] if text else []


def _chat_messages(message: Message, where: str) -> list[ChatMessage]:
    """One Anthropic message as chat messages (a user turn's tool results are one each)."""
    role, content = message.role, message.content
    if role == "system":
        return _system_messages(content, f"{where}.content")
    if role not in ("user", "assistant"):
        raise bad(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    if role == "user":
        return _user_messages(content, f"{where}.content")
    return [_assistant_message(content, f"{where}.content")]


def _user_messages(blocks: list[Block], where: str) -> list[ChatMessage]:
    results: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block.type == "text":
            texts.append(_text(block, at))
        elif block.type == "tool_result":
            results.append(_tool_message(block, at))
        else:
            raise unsupported_block(block, at, "'text' and 'tool_result'")
    if texts or not results:
        results.append(ChatMessage("user", "\n".join(texts)))
    return results


def _tool_message(block: Block, where: str) -> ChatMessage:
    if block.tool_use_id is None:
        raise bad(f"{where}.tool_use_id", "required in a 'tool_result' block")
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _text_of(content, f"{where}.content")
    if block.is_error:
        text = "Error: " + text
    return ChatMessage("tool", text, tool_call_id=block.tool_use_id)


def _assistant_message(blocks: list[Block], where: str) -> ChatMessage:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[MessageToolCall] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block.type == "text":
            texts.append(_text(block, at))
        elif block.type == "tool_use":
            for name in ("id", "name", "input"):
                if getattr(block, name) is None:
                    raise bad(f"{at}.{name}", "required in a 'tool_use' block")
            assert block.name is not None  # (checked above, for mypy)
            arguments = json.dumps(block.input)
            calls.append(MessageToolCall(ToolCallFunction(block.name, arguments), block.id))
        elif block.type == "thinking":
            reasoning.append(block.thinking or "")
        elif block.type != "redacted_thinking":  # Anthropic's encryption: nothing to read
            raise unsupported_block(block, at, "'text', 'tool_use' and 'thinking'")
    content = "\n".join(texts) if texts or not calls else None
    return ChatMessage(
        "assistant",
        content,
        tool_calls=calls or None,
        reasoning_content="".join(reasoning) if reasoning else None,
    )


def _tool(spec: ToolSpec, where: str) -> Tool:
    if spec.type not in (None, "custom"):
        raise bad(
            f"{where}.type",
            f"{spec.type!r} is one of Anthropic's server tools, which "
            f"this server does not run: define a custom tool (name, description, "
            f"input_schema) and run it yourself",
        )
    if spec.name is None:
        raise bad(f"{where}.name", "required")
    if spec.input_schema is None:
        raise bad(f"{where}.input_schema", "required")
    if spec.defer_loading:
        raise bad(f"{where}.defer_loading", "not supported (there is no tool search here)")
    if spec.allowed_callers not in (None, ["direct"]):
        raise bad(f"{where}.allowed_callers", "only 'direct' callers are supported")
    description = spec.description
    if spec.input_examples:  # the model reads them where it reads the description
        examples = "\n".join(json.dumps(e) for e in spec.input_examples)
        description = f"{description or ''}\n\nExample inputs:\n{examples}".lstrip()
    return Tool("function", FunctionDef(spec.name, description, spec.input_schema, spec.strict))


def _tool_choice(spec: ToolChoiceSpec | None) -> tuple[ToolChoice | None, bool]:
    """Chat's tool_choice and parallel_tool_calls."""
    if spec is None:
        return None, True
    parallel = not spec.disable_parallel_tool_use
    if spec.type == "tool":
        if spec.name is None:
            raise bad("tool_choice.name", "required when tool_choice.type is 'tool'")
        return NamedToolChoice("function", NamedFunction(spec.name)), parallel
    choice = TOOL_CHOICES.get(spec.type)
    if choice is None:
        raise bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {spec.type!r}")
    return choice, parallel


def _response_format(config: OutputConfig | None) -> ResponseFormat | None:
    if config is None or config.format is None:
        return None
    if config.format.type != "json_schema":
        raise bad("output_config.format.type", f"must be 'json_schema', got {config.format.type!r}")
    if config.format.schema is None:
        raise bad("output_config.format.schema", "required")
    return ResponseFormat("json_schema", JsonSchemaFormat(schema=config.format.schema))
