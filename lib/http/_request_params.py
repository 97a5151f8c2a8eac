"""An OpenAI request's fields as the engine's `SamplingParams`.

Range checks are the engine's (`SamplingParams`); `to_sampling_params` only renames the field
in its message to the one the client sent (`top_logprobs`, `max_completion_tokens`), reads
null as the default, and checks token ids against the vocabulary: the engine would refuse
them only after the response started.
"""

from __future__ import annotations

from typing import TypeVar

from ..engine.client import MAX_LOGIT_BIAS, SamplingParams, SamplingParamsError
from ._constraints import constraint
from ._errors import RequestError
from ._requests import ChatCompletionRequest, CompletionRequest


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    tool_format: str = "hermes",
    vocab_size: int | None = None,
) -> SamplingParams:
    """The engine's validated parameters for `request` (its token ids checked against
    `vocab_size` when given: the engine would refuse them only after the response started).

    Chat: `logprobs: true` asks for the sampled token's logprob plus `top_logprobs` (default
    0) alternatives. Completions: `logprobs` is the top count; with `echo`, the prompt's
    logprobs are asked for too.

    Raises:
        RequestError: 400 with `param` the field the client sent (a value out of range, a
            logit_bias key that is not an integer, a token id outside the vocabulary,
            top_logprobs without logprobs).
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
    structured = constraint(
        structured_outputs=request.structured_outputs,
        response_format=request.response_format,
        tools=getattr(request, "tools", None),
        tool_choice=getattr(request, "tool_choice", None),
        parallel_tool_calls=_or(getattr(request, "parallel_tool_calls", None), True),
        tool_format=tool_format,
    )
    try:
        params = SamplingParams(
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
            structured_outputs=structured,
            cache_salt=request.cache_salt,
            thinking_token_budget=request.thinking_token_budget,
        )
        if vocab_size is not None:
            params.check_vocab(vocab_size)
        return params
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
    if len(bias) > MAX_LOGIT_BIAS:  # before a loop over them
        raise RequestError(
            400,
            f"the number of logit_bias entries must be <= {MAX_LOGIT_BIAS}, got {len(bias)}",
            param="logit_bias",
        )
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
