"""OpenAI's request and response bodies as msgspec Structs, and the mapping to `SamplingParams`.

Requests decode straight into Structs with decoders built once; unknown fields are ignored,
as OpenAI ignores them, and every field OpenAI documents as nullable accepts `null` (meaning
its default). A body that does not decode is a 400 `RequestError` naming the field. Range
checks are the engine's (`SamplingParams`); `to_sampling_params` only renames the field in
its message to the one the client sent (`top_logprobs`, `max_completion_tokens`).

Responses are Structs encoded by one encoder, in OpenAI's exact shapes (checked in the tests
with the official SDK's models), plus vLLM's `stop_reason` on each choice.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, TypeVar, cast

import msgspec

from ..engine import Output, SamplingParams, SamplingParamsError, TokenLogprob
from ._errors import RequestError

S = TypeVar("S", bound=msgspec.Struct)
TokenText = Callable[[int], str]  # a token id's text, for logprobs (the tokenizer's)

SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # vLLM's floor: JSON has no -inf


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool | None = False


class ContentPart(msgspec.Struct, frozen=True):
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


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None  # null: an assistant turn of tool calls
    name: str | None = None

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
        entry = {"role": m.role, "content": m.text}
        out.append(entry if m.name is None else {**entry, "name": m.name})
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

    def __post_init__(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/completions`. `logprobs` is a top count; `echo` prepends the prompt."""

    prompt: str | list[str | int | list[int]]  # one array-like type per union, for msgspec
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.prompts

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batch: one text or one token-id list per prompt.

        Raises:
            RequestError: the prompt is an empty list, or a list that mixes kinds.
        """
        prompt = self.prompt
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
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over `max_tokens`."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: int | None = None  # None: up to the model's maximum length
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /tokenize`: a prompt, or messages under the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError(400, "send either prompt or messages (exactly one)", param="prompt")


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
    try:
        return cast(S, decoder.decode(body))
    except msgspec.ValidationError as err:  # (a DecodeError: catch it first)
        raise _validation_error(str(err)) from None
    except msgspec.DecodeError as err:
        raise RequestError(400, f"the body is not valid JSON: {err}") from None


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


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The engine's validated parameters for `request`.

    Chat: `logprobs: true` asks for the sampled token's logprob plus `top_logprobs` (default
    0) alternatives. Completions: `logprobs` is the top count; with `echo`, the prompt's
    logprobs are asked for too.

    Raises:
        RequestError: 400 with `param` the field the client sent (a value out of range, a
            logit_bias key that is not an integer, top_logprobs without logprobs).
    """
    renames: dict[str, str]
    if isinstance(request, ChatCompletionRequest):
        max_tokens, renames = request.max_tokens, {"logprobs": "top_logprobs"}
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        if request.top_logprobs and not request.logprobs:
            raise RequestError(
                400,
                f"top_logprobs is {request.top_logprobs} but logprobs is not true: set logprobs "
                f"to true to get top logprobs",
                param="top_logprobs",
            )
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        prompt_logprobs = None
    else:
        max_tokens, renames = request.max_tokens, {"prompt_logprobs": "logprobs"}
        logprobs = request.logprobs
        prompt_logprobs = logprobs if request.echo else None
    d = _DEFAULTS
    try:
        return SamplingParams(
            n=_or(request.n, d.n),
            max_tokens=max_tokens,
            min_tokens=_or(request.min_tokens, d.min_tokens),
            temperature=_or(request.temperature, d.temperature),
            top_p=_or(request.top_p, d.top_p),
            top_k=_or(request.top_k, d.top_k),
            min_p=_or(request.min_p, d.min_p),
            presence_penalty=_or(request.presence_penalty, d.presence_penalty),
            frequency_penalty=_or(request.frequency_penalty, d.frequency_penalty),
            repetition_penalty=_or(request.repetition_penalty, d.repetition_penalty),
            logit_bias=_logit_bias(request.logit_bias),
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=_or(request.ignore_eos, d.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=_or(request.skip_special_tokens, d.skip_special_tokens),
            include_stop_str_in_output=_or(
                request.include_stop_str_in_output, d.include_stop_str_in_output
            ),
        )
    except SamplingParamsError as err:
        param, message = renames.get(err.field, err.field), str(err)
        if param != err.field and message.startswith(err.field):
            message = param + message[len(err.field) :]
        raise RequestError(400, message, param=param) from err


T = TypeVar("T")
_DEFAULTS = SamplingParams()  # for fields sent as null


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise RequestError(
                400,
                f"logit_bias keys must be token ids (integers), got {key!r}",
                param="logit_bias",
            ) from None
    return out


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


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    total = prompt_tokens + completion_tokens
    return Usage(prompt_tokens, completion_tokens, total, PromptTokensDetails(cached_tokens))


def usage_of(outputs: Iterable[Output], *, n: int) -> Usage:
    """The usage of the (last) outputs of every choice; choice i is of prompt i // n.

    A prompt counts once however many choices it has, as OpenAI counts it; its cached
    tokens are those of its first choice.
    """
    prompts: dict[int, Output] = {}
    completion_tokens = 0
    for output in outputs:
        completion_tokens += output.num_output_tokens
        first = prompts.setdefault(output.index // n, output)
        if output.index < first.index:
            prompts[output.index // n] = output
    prompt_tokens = sum(o.num_prompt_tokens for o in prompts.values())
    return usage(
        prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in prompts.values())
    )


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


class ChatResponseMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatDelta(msgspec.Struct):
    role: str | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET  # null until the usage chunk
    object: str = "chat.completion.chunk"


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
) -> bytes:
    """A `text_completion`: one choice per output (index `output.index`), and the usage.

    Args:
        outputs: every choice's merged output; for a batch of prompts, renumbered so that
            choice `i` is of prompt `i // n`.
        n: choices per prompt.
        echo: the prompts (in batch order), to prepend when the request set `echo`.
    """
    choices = [
        _completion_choice(o, token_text, echo[o.index // n] if echo else None, 0) for o in outputs
    ]
    body = Completion(meta.id, meta.created, meta.model, choices, usage_of(outputs, n=n))
    return _encoder.encode(body)


def completion_chunk(
    meta: ResponseMeta,
    output: Output,
    *,
    token_text: TokenText,
    text_offset: int = 0,
    echo: EchoPrompt | None = None,
    include_usage: bool = False,
) -> bytes:
    """One streamed `text_completion` chunk with the new text of one choice.

    Args:
        text_offset: the length of the choice's text streamed so far (logprobs' offsets
            continue from it).
        echo: the prompt, on the choice's first chunk only, when the request set `echo`.
        include_usage: the stream ends with a usage chunk, so this one says `"usage": null`.
    """
    choice = _completion_choice(output, token_text, echo, text_offset)
    usage_field: Usage | msgspec.UnsetType | None = None if include_usage else msgspec.UNSET
    return _encoder.encode(Completion(meta.id, meta.created, meta.model, [choice], usage_field))


def completion_usage_chunk(meta: ResponseMeta, usage: Usage) -> bytes:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return _encoder.encode(Completion(meta.id, meta.created, meta.model, [], usage))


def chat_completion_response(
    meta: ResponseMeta, outputs: Sequence[Output], *, n: int, token_text: TokenText
) -> bytes:
    """A `chat.completion`: one assistant message per output (index `output.index`)."""
    choices = [
        ChatChoice(
            o.index,
            ChatResponseMessage(o.text),
            _chat_logprobs(o.logprobs, token_text),
            o.finish_reason,
            o.stop_reason,
        )
        for o in outputs
    ]
    body = ChatCompletion(meta.id, meta.created, meta.model, choices, usage_of(outputs, n=n))
    return _encoder.encode(body)


def chat_completion_chunk(
    meta: ResponseMeta,
    output: Output,
    *,
    token_text: TokenText,
    first: bool = False,
    include_usage: bool = False,
) -> bytes:
    """One `chat.completion.chunk` with the new text of one choice.

    Args:
        first: the choice's first chunk: its delta carries `role: "assistant"` and `content`
            even if empty (OpenAI's first chunk is `{"role": "assistant", "content": ""}`).
            Later deltas without text are `{}`.
        include_usage: the stream ends with a usage chunk, so this one says `"usage": null`.
    """
    delta = ChatDelta(
        role="assistant" if first else msgspec.UNSET,
        content=output.text if output.text or first else msgspec.UNSET,
    )
    choice = ChatChunkChoice(
        output.index,
        delta,
        _chat_logprobs(output.logprobs, token_text),
        output.finish_reason,
        output.stop_reason,
    )
    usage_field: Usage | msgspec.UnsetType | None = None if include_usage else msgspec.UNSET
    body = ChatCompletionChunk(meta.id, meta.created, meta.model, [choice], usage_field)
    return _encoder.encode(body)


def chat_usage_chunk(meta: ResponseMeta, usage: Usage) -> bytes:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return _encoder.encode(ChatCompletionChunk(meta.id, meta.created, meta.model, [], usage))


class StreamChunker:
    """The chunks of one streamed response, from its outputs as they come.

    It holds what OpenAI's stream shape needs across chunks: whether a choice has started
    (chat's role chunk, completions' echo), each choice's text offset (logprobs), and the
    token counts for the final usage chunk. An echoed prompt waits for the choice's first
    token, so that all of the prompt's logprobs (which arrive in pieces, one per prefill
    chunk) are in its first chunk.
    """

    def __init__(
        self,
        meta: ResponseMeta,
        *,
        chat: bool,
        n: int,
        token_text: TokenText,
        include_usage: bool = False,
        echo: Sequence[EchoPrompt] | None = None,
    ) -> None:
        self.meta, self.chat, self.n = meta, chat, n
        self.token_text = token_text
        self.include_usage = include_usage
        self.echo = echo
        self._offsets: dict[int, int] = {}  # choice -> text streamed so far (started choices)
        self._held: dict[int, list[TokenLogprob | None]] = {}  # echo: prompt logprobs so far
        self._last: dict[int, Output] = {}  # choice -> a summary of its counts

    def chunks(self, output: Output) -> list[bytes]:
        """The chunks to send for `output`, in order; often one.

        None if it has nothing to show (no text, no logprobs, not the end) or while an echo
        waits for the first token; a chat choice's first output gets a role chunk before.
        """
        self._count(output)
        index, started = output.index, output.index in self._offsets
        if not (output.text or output.logprobs or output.finished):
            if self.echo and not started and output.prompt_logprobs:
                self._held.setdefault(index, []).extend(output.prompt_logprobs)
            return []
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(output.text)
        usage, text_of = self.include_usage, self.token_text
        if self.chat:
            chunk = chat_completion_chunk(
                self.meta, output, token_text=text_of, include_usage=usage
            )
            if started:
                return [chunk]
            role = chat_completion_chunk(
                self.meta,
                Output(index, "", []),
                token_text=text_of,
                first=True,
                include_usage=usage,
            )
            return [role, chunk]
        echo = None if started or not self.echo else self.echo[index // self.n]
        if echo is not None:
            self._offsets[index] += len(echo.text)
            held = self._held.pop(index, [])
            if held:
                output = dataclasses.replace(
                    output, prompt_logprobs=held + (output.prompt_logprobs or [])
                )
        chunk = completion_chunk(
            self.meta,
            output,
            token_text=text_of,
            text_offset=offset,
            echo=echo,
            include_usage=usage,
        )
        return [chunk]

    def usage(self) -> Usage:
        """The usage of everything streamed so far."""
        return usage_of(self._last.values(), n=self.n)

    def usage_chunk(self) -> bytes:
        """The last chunk when the request set `stream_options.include_usage`."""
        if self.chat:
            return chat_usage_chunk(self.meta, self.usage())
        return completion_usage_chunk(self.meta, self.usage())

    def _count(self, output: Output) -> None:
        last = self._last.get(output.index)
        if last is None:
            self._last[output.index] = Output(
                output.index,
                "",
                [],
                None,
                None,
                None,
                output.num_prompt_tokens,
                output.num_output_tokens,
                output.num_cached_tokens,
            )
            return
        # Counts are cumulative, but an output that carried only prompt logprobs has zeros.
        last.num_prompt_tokens = max(last.num_prompt_tokens, output.num_prompt_tokens)
        last.num_output_tokens = max(last.num_output_tokens, output.num_output_tokens)
        last.num_cached_tokens = max(last.num_cached_tokens, output.num_cached_tokens)


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
    for token_id, lp in entries:
        text = token_text(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
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
        token = token_text(lp.token_id)
        top = [_top_logprob(token_text(t), v) for t, v in lp.top]
        content.append(
            ChatTokenLogprob(token, max(lp.logprob, MIN_LOGPROB), list(token.encode()), top)
        )
    return ChatLogprobs(content)


def _top_logprob(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token, max(logprob, MIN_LOGPROB), list(token.encode()))


# -- the small endpoints ------------------------------------------------------------------


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "trillm"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


def models_response(
    model_ids: Iterable[str], *, max_model_len: int, created: int | None = None
) -> bytes:
    """`GET /v1/models`: every served model name (`created`: now unless given)."""
    created = int(time.time()) if created is None else created
    cards = [ModelCard(name, created, max_model_len) for name in model_ids]
    return _encoder.encode(ModelList(cards))


def tokenize_response(tokens: list[int], *, max_model_len: int) -> bytes:
    return _encoder.encode(TokenizeResponse(tokens, len(tokens), max_model_len))


def detokenize_response(prompt: str) -> bytes:
    return _encoder.encode(DetokenizeResponse(prompt))


def version_response(version: str) -> bytes:
    return _encoder.encode(VersionResponse(version))
