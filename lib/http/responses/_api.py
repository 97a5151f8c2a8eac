"""OpenAI's Responses API (`POST /v1/responses`), translated onto a chat request.

The request's `instructions`, the stored conversation its `previous_response_id` names, and
its `input` items become chat messages (`_requests.ChatMessage`: a `function_call` is an
assistant turn's tool call, a `function_call_output` a tool turn, a `reasoning` item the next
assistant turn's `reasoning_content`); its tools, tool choice and `text.format` become the
chat request's, so one grammar, one tool parser and one reasoning parser serve all three APIs
(`Generation.plan_chat`). `responses/_face` names the output items and stream events.

What the server cannot do is refused with a 400 naming the field, never ignored: built-in
tools (`web_search`, `file_search`, ...), `conversation`, `prompt`, `truncation: auto`,
`max_tool_calls`, input images, files and audio, reasoning summaries. `top_logprobs`, or
`include: ["message.output_text.logprobs"]`, asks for the output text's logprobs (chat's
`logprobs` and `top_logprobs`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..edge._admission import Held
from ..edge._errors import RequestError, fields_renamed
from ..openai._requests import ChatCompletionRequest, ChatMessage, MessageToolCall, ToolCallFunction
from ..turn._constraints import (
    FormatName,
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
from ._background import BackgroundResponses, check_background, respond
from ._checks import LOGPROBS_INCLUDE, refuse_unserved
from ._face import ResponsesFace
from ._store import ResponseStore

# Chat's field names in errors, as this API calls them.
RENAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "prompt": "input",
    "reasoning_effort": "reasoning.effort",
}
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "summary_text"})


class InputPart(msgspec.Struct, frozen=True, gc=False):
    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One input item; `type` picks which fields it has (a message may leave it out)."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# The response echoes these as sent (`omit_defaults`): an unset field is no field, where
# OpenAI's schema has no null for it (`text.format.description`, `tool_choice.name`).
class ToolChoiceObject(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    type: str
    name: FormatName | None = None  # OpenAI's rule, as chat's response_format
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, frozen=True, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/responses`; null means the default, as everywhere in the server."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    # Defined by the API, not served here: a 400 when set (`refuse_unserved`).
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None

    @property
    def wants_logprobs(self) -> bool:
        """Whether the output text's parts carry logprobs (OpenAI: either asks for them)."""
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())


class ResponsesAPI:
    """The route's handler: translate, plan, run, store."""

    def __init__(self, generation: Generation, store: ResponseStore) -> None:
        self.generation = generation
        self.store = store
        self.background = BackgroundResponses(generation, store)

    async def create(
        self,
        request: ResponsesRequest,
        held: Held,
        receive: Any,
        send: Any,
        extra: list[Any],
        *,
        rank: int | None = None,
    ) -> None:
        refuse_unserved(request, self.generation.llm.config.reasoning_parser)
        if request.background:
            check_background(request, self.store)
        history: list[ChatMessage] = []
        if request.previous_response_id is not None:
            if self.background.is_running(request.previous_response_id):
                raise RequestError(
                    400,
                    f"response {request.previous_response_id!r} is still in progress: continue "
                    f"it once it has completed",
                    param="previous_response_id",
                )
            history = list(self.store.conversation(request.previous_response_id).messages)
        given = input_messages(request.input)
        system = [ChatMessage("system", request.instructions)] if request.instructions else []
        with fields_renamed(RENAMES):
            chat = chat_request(request, system + history + given)
            chat.data_parallel_rank = rank  # the engine its header pinned (`Edge.rank`)
            plan = await self.generation.plan_chat(chat, held)
        store = self.store if request.store is not False and self.store.enabled else None
        pieces = self.generation.llm.token_pieces if request.wants_logprobs else None
        face = ResponsesFace(request, self.generation.config, store, history + given, pieces)
        if request.background:
            body = self.background.start(face, plan, held)
            await respond(send, 200, body, extra)
            return
        await run_turn(
            self.generation,
            plan,
            face,
            stream=bool(request.stream),
            receive=receive,
            send=send,
            extra=extra,
        )


def input_messages(given: str | list[InputItem] | None) -> list[ChatMessage]:
    """The input as chat messages; consecutive calls join one assistant turn, and a
    reasoning item goes with the assistant turn after it.

    Raises:
        RequestError: 400 naming the item: an unknown type, a part that is not text, a call
            without its `call_id` or `name`.
    """
    if isinstance(given, str):
        return [ChatMessage("user", given)]
    out: list[ChatMessage] = []
    reasoning: str | None = None
    for i, item in enumerate(given or ()):
        kind = item.type or "message"
        where = f"input[{i}]"
        if kind == "message":
            role = {"developer": "system"}.get(item.role or "", item.role)
            if role not in ("user", "system", "assistant"):
                raise RequestError(
                    400,
                    f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got "
                    f"{item.role!r}",
                    param=f"{where}.role",
                )
            text = _text(item.content, f"{where}.content")
            if role == "assistant":
                out.append(ChatMessage("assistant", text, reasoning_content=reasoning))
                reasoning = None
            else:
                out.append(ChatMessage(role, text))
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise RequestError(
                    400, f"{where}: a function_call needs call_id and name", param=where
                )
            call = MessageToolCall(
                ToolCallFunction(item.name, item.arguments or "{}"), item.call_id
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and reasoning is None:
                calls = [*(last.tool_calls or ()), call]
                out[-1] = msgspec.structs.replace(last, tool_calls=calls)
            else:
                out.append(
                    ChatMessage("assistant", None, tool_calls=[call], reasoning_content=reasoning)
                )
                reasoning = None
        elif kind == "function_call_output":
            if not item.call_id:
                raise RequestError(
                    400, f"{where}: a function_call_output needs call_id", param=where
                )
            output = _text(item.output, f"{where}.output")
            out.append(ChatMessage("tool", output, tool_call_id=item.call_id))
        elif kind == "reasoning":
            if item.encrypted_content is not None:
                raise RequestError(
                    400,
                    f"{where}.encrypted_content cannot be read here: trillm returns reasoning as "
                    f"text, never encrypted; send the reasoning as the item's content or summary",
                    param=f"{where}.encrypted_content",
                )
            parts = [p.text or "" for p in (item.summary or ())]
            if isinstance(item.content, list):
                parts = [p.text or "" for p in item.content] or parts
            reasoning = (reasoning or "") + "\n".join(parts)
        else:
            raise RequestError(
                400,
                f"{where}.type {kind!r} is not supported: send messages, function_call, "
                f"function_call_output and reasoning items",
                param=f"{where}.type",
            )
    return out


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS and part.type != "reasoning_text":
            raise RequestError(
                400,
                f"{where}[{j}].type {part.type!r} is not supported: this server reads text "
                f"parts only",
                param=f"{where}[{j}].type",
            )
        texts.append(part.text if part.text is not None else part.refusal or "")
    return "\n".join(texts)


def chat_request(request: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that runs `request` over `messages`.

    Raises:
        RequestError: 400 naming the field: a built-in tool, a tool choice that is not a
            function, a text format that is not text, json_object or json_schema.
    """
    if not messages:
        raise RequestError(400, "input is empty: send at least one item", param="input")
    tools = [_function(t, f"tools[{i}]") for i, t in enumerate(request.tools or ())] or None
    return ChatCompletionRequest(
        messages=messages,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        user=request.user or request.safety_identifier,
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_format(request.text),
        # A template that reads reasoning_effort (gpt-oss's) renders it, as in vLLM.
        reasoning_effort=request.reasoning.effort if request.reasoning is not None else None,
        logprobs=request.wants_logprobs,
        top_logprobs=request.top_logprobs,
    )


def _function(tool: FunctionTool, where: str) -> Tool:
    if tool.type != "function":
        raise RequestError(
            400,
            f"{where}.type {tool.type!r} is not supported: this server runs no built-in tools "
            f"(web_search, file_search, code_interpreter, ...); send function tools",
            param=f"{where}.type",
        )
    if not tool.name:
        raise RequestError(400, f"{where}.name is required", param=f"{where}.name")
    strict = True if tool.strict is None else tool.strict  # the Responses API's default
    return Tool("function", FunctionDef(tool.name, tool.description, tool.parameters, strict))


def _tool_choice(choice: str | ToolChoiceObject | None) -> ToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise RequestError(
            400,
            f"tool_choice of type {choice.type!r} is not supported: send 'auto', 'none', "
            f"'required' or {{'type': 'function', 'name': ...}}",
            param="tool_choice",
        )
    return NamedToolChoice("function", NamedFunction(choice.name))


def _format(text: TextConfig | None) -> ResponseFormat | None:
    if text is None or text.format is None or text.format.type == "text":
        return None
    f = text.format
    if f.type == "json_schema":
        schema = JsonSchemaFormat(f.name or "response", f.schema, f.strict, f.description)
        return ResponseFormat("json_schema", schema)
    return ResponseFormat(f.type)  # json_object, or a 400 naming the type
