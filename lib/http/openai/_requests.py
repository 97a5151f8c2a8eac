"""OpenAI's request bodies as msgspec Structs, and their mapping to `SamplingParams`.

Requests decode straight into Structs with decoders built once; unknown fields are ignored
and logged, as vLLM does (`_unknown_fields`; OpenAI answers 400), and every field OpenAI
documents as nullable accepts `null` (meaning its default). A body that does not decode is a
400 `RequestError` naming the field, and so is one that nests deeper than `MAX_JSON_DEPTH`
(measured on its bytes before decoding, as is a tool call's `arguments` text). Range checks
are the engine's (`SamplingParams`); their mapping to `SamplingParams` is
`_request_params.to_sampling_params`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar, cast

import msgspec

from ...engine.client import (
    StructuredOutputs,
)
from ..edge._errors import RequestError
from ..edge._json_depth import MAX_JSON_DEPTH, nests_deeper
from ..edge._unknown_fields import log_unknown_fields
from ..turn._constraints import ResponseFormat, Tool, ToolChoice

S = TypeVar("S", bound=msgspec.Struct)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk


# The parts of a conversation are untracked by the garbage collector (`gc=False`: decoded from
# JSON, they cannot form a cycle): 120,000 tracked messages set off collections of the
# whole heap, which stalled every stream.


class ContentPart(msgspec.Struct, frozen=True, gc=False):
    """A part of a message's content; only text parts are served (the engine reads text)."""

    type: str
    text: str | None = None

    def __post_init__(self) -> None:
        if self.type != "text":
            raise RequestError(
                400,
                f"content parts of type {self.type!r} are not supported: send 'text' parts",
                param="messages",
            )
        if self.text is None:
            raise RequestError(400, "a content part of type 'text' needs 'text'", param="messages")


class ToolCallFunction(msgspec.Struct, frozen=True, gc=False):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text

    def __post_init__(self) -> None:
        # The text is parsed later (`json.loads`, which recurses): refused here if too deep.
        if isinstance(self.arguments, str) and nests_deeper(self.arguments, MAX_JSON_DEPTH):
            raise RequestError(
                400,
                f"a tool call's function.arguments nests deeper than {MAX_JSON_DEPTH} arrays "
                f"and objects; flatten it",
                param="messages",
            )


class MessageToolCall(msgspec.Struct, frozen=True, gc=False):
    function: ToolCallFunction
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, frozen=True, gc=False):
    role: str
    content: str | list[ContentPart] | None = None  # null: an assistant turn of tool calls
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # an assistant turn's reasoning, as vLLM and Qwen3's template name it (a template that
    # reads it shows it; the others drop it, as they drop it from their own turns)
    reasoning_content: str | None = None

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM joins them."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text or "" for part in self.content)


def chat_template_messages(messages: Iterable[ChatMessage]) -> list[dict[str, Any]]:
    """`messages` as the dicts a Hugging Face chat template reads."""
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = [msgspec.to_builtins(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            entry["reasoning_content"] = m.reasoning_content
        out.append(entry)
    return out


class _SamplingFields(msgspec.Struct, kw_only=True):
    """The fields completions and chat share; null means the default shown."""

    model: str | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None  # vLLM's extensions from here: None is off
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = 0
    seed: int | None = None
    logit_bias: dict[str, float] | None = None  # token ids as strings, as JSON keys must be
    user: str | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprobs' tokens as "token_id:N"
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    response_format: ResponseFormat | None = None  # OpenAI's
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only within one salt
    data_parallel_rank: int | None = None  # vLLM's: the engine to run on (`_rank`)
    thinking_token_budget: int | None = None  # vLLM's: reasoning tokens at most (a grammar)
    # vLLM's, checked in `_request_params.refuse_unserved`: the prompt's logprobs (top k per
    # position); the prompt's and each choice's token ids in the response; beam search and
    # best_of, which are refused (400) unless they ask for nothing beyond `n`.
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = False
    use_beam_search: bool | None = False
    best_of: int | None = None

    def __post_init__(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far (vLLM's
        `continuous_usage_stats`, which here needs no `include_usage`)."""
        options = self.stream_options
        return bool(self.stream and options and options.continuous_usage_stats)


class CompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/completions`. `logprobs` is a top count; `echo` prepends the prompt.

    vLLM's `prompt_embeds` (base64 of a safetensors file, or a list of them: one prompt each)
    stands for the prompt; `prompt` is then "" (what the openai SDK must send) or left out.
    """

    # one array-like type per union, for msgspec
    prompt: str | list[str | int | list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    prompt_embeds: str | list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt_embeds is None:
            _ = self.prompts
        elif self.prompt not in (None, ""):
            raise RequestError(
                400,
                'send either prompt or prompt_embeds: with prompt_embeds, prompt must be "" or '
                "left out",
                param="prompt",
            )
        elif not self.prompt_embeds:
            raise RequestError(
                400,
                "prompt_embeds must be a base64 string or a non-empty list of them",
                param="prompt_embeds",
            )

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batch: one text or one token-id list per prompt.

        Raises:
            RequestError: no prompt, the prompt is an empty list, or a list that mixes kinds.
        """
        prompt = self.prompt
        if prompt is None:
            raise RequestError(400, "prompt is required", param="prompt")
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [cast(list[int], prompt)]
        if prompt and all(isinstance(p, str) for p in prompt):
            return cast(list[str | list[int]], prompt)
        if prompt and all(isinstance(p, list) and p for p in prompt):
            return cast(list[str | list[int]], prompt)
        raise RequestError(
            400,
            "prompt must be a string, a list of strings, a non-empty list of token ids, or a "
            "list of non-empty token-id lists",
            param="prompt",
        )


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over `max_tokens`.

    vLLM's: `add_generation_prompt` false renders no opened assistant turn;
    `continue_final_message` renders the final (assistant) message open, to be continued;
    `echo` starts each choice's content with that final assistant message's text.
    """

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: int | None = None  # None: up to the model's maximum length
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # Variables for the chat template: vLLM's chat_template_kwargs (Qwen3's enable_thinking),
    # and OpenAI's reasoning_effort, which a template that reads it (gpt-oss's) renders.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    echo: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False

    def __post_init__(self) -> None:
        super().__post_init__()
        template_kwargs(self.chat_template_kwargs, self.reasoning_effort)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /tokenize`: a prompt, or messages under the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False  # vLLM's: each id's token string too

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError(400, "send either prompt or messages (exactly one)", param="prompt")
        template_kwargs(self.chat_template_kwargs)


# What the template call itself takes: a request's template variables may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
    }
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_kwargs(
    kwargs: dict[str, Any] | None, reasoning_effort: str | None = None
) -> dict[str, Any]:
    """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort`.

    Raises:
        RequestError: 400: a name the template call reserves (vLLM refuses them too: one
            could swap the template or the messages), or an effort OpenAI does not define.
    """
    variables = dict(kwargs or {})
    for name in variables:
        if name in RESERVED_TEMPLATE_KWARGS or name.startswith("_"):
            raise RequestError(
                400,
                f"chat_template_kwargs may not set {name!r}: it is the template call's own "
                f"argument, not a template variable",
                param=f"chat_template_kwargs.{name}",
            )
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise RequestError(
                400,
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                f"{reasoning_effort!r}",
                param="reasoning_effort",
            )
        variables.setdefault("reasoning_effort", reasoning_effort)
    return variables


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind)
    for kind in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
}
_AT = re.compile(r"(?P<reason>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?", re.DOTALL)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]*)`")


def decode_request(body: bytes, kind: type[S]) -> S:
    """Decode a request body into `kind`.

    Raises:
        RequestError: 400: the body is not JSON, or a field is missing or of the wrong type
            (`param` names it, e.g. "max_tokens" or "messages[0].role").
    """
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    if nests_deeper(body, MAX_JSON_DEPTH):
        raise _too_deep()
    try:
        request = cast(S, decoder.decode(body))
    except msgspec.ValidationError as err:  # (a DecodeError: catch it first)
        raise _validation_error(str(err)) from None
    except msgspec.DecodeError as err:
        raise RequestError(400, f"the body is not valid JSON: {err}") from None
    except RecursionError:  # not expected past the check above; never a 500 if it is
        raise _too_deep() from None
    log_unknown_fields(body, kind)
    return request


def _too_deep() -> RequestError:
    return RequestError(
        400,
        f"the request body nests deeper than {MAX_JSON_DEPTH} arrays and objects one inside "
        f"another; flatten it",
        code="too_deep",
    )


def _validation_error(text: str) -> RequestError:
    match = _AT.fullmatch(text)
    reason, path = (match["reason"], match["path"] or "") if match else (text, "")
    path = path.replace("[...]", "")  # a dict's values: name the dict
    missing = _MISSING.fullmatch(reason)
    if missing is not None:
        field = f"{path}.{missing['field']}" if path else missing["field"]
        return RequestError(400, f"{field} is required", param=field)
    reason = reason[:1].lower() + reason[1:]
    if path:
        return RequestError(400, f"invalid {path}: {reason}", param=path)
    return RequestError(400, f"invalid request body: {reason}")
