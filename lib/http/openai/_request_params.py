"""An OpenAI request's fields as the engine's `SamplingParams`.

Range checks are the engine's (`SamplingParams`); `to_sampling_params` only renames the field
in its message to the one the client sent (`top_logprobs`, `max_completion_tokens`), reads
null as the default, and checks token ids against the vocabulary: the engine would refuse
them only after the response started.
"""

from __future__ import annotations

from typing import TypeVar

from ...engine.client import MAX_LOGIT_BIAS, SamplingParams, SamplingParamsError
from ..edge._errors import RequestError
from ..turn._constraints import constraint
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

    `prompt_logprobs` (vLLM's) asks for the prompt's logprobs whatever `echo` says, and sets
    their top count (an echo's too).

    Raises:
        RequestError: 400 with `param` the field the client sent (a value out of range, a
            logit_bias key that is not an integer, a token id outside the vocabulary,
            top_logprobs without logprobs, a field trillm does not serve:
            `refuse_unserved`).
    """
    refuse_unserved(request)
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
        prompt_logprobs = request.prompt_logprobs
    else:
        max_tokens, renames = request.max_tokens, {}
        logprobs = request.logprobs
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs, renames["prompt_logprobs"] = logprobs, "logprobs"
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


def refuse_unserved(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, naming it, each field that would otherwise be accepted and do nothing.

    Beam search is not served (trillm samples each choice on its own): `use_beam_search`
    true is a 400, and so is a `best_of` other than `n` (the best of more candidates than
    are returned is beam-like search too). `prompt_logprobs` -1 (the whole vocabulary at
    every position) is refused, and prompt logprobs in a stream, as vLLM refuses them.

    Raises:
        RequestError: 400 whose `param` is the field.
    """
    if request.use_beam_search:
        raise RequestError(
            400,
            "use_beam_search is not supported: trillm samples each choice independently; "
            "send n (and a seed for reproducible choices) instead",
            param="use_beam_search",
        )
    n = _or(request.n, 1)
    if request.best_of is not None and request.best_of != n:
        raise RequestError(
            400,
            f"best_of is not supported except equal to n ({n}), got {request.best_of}: every "
            f"choice sampled is returned; send n instead",
            param="best_of",
        )
    if request.prompt_logprobs == -1:
        raise RequestError(
            400,
            "prompt_logprobs -1 (the whole vocabulary at every position) is not supported: "
            "ask for a top count from 0 to 20",
            param="prompt_logprobs",
        )
    if request.prompt_logprobs is not None and request.stream:
        raise RequestError(
            400,
            "prompt_logprobs is not available when stream is true: send it without streaming",
            param="prompt_logprobs",
        )
    if isinstance(request, ChatCompletionRequest):
        _refuse_unserved_chat(request)
    elif request.return_token_ids and request.prompt_embeds is not None:
        raise RequestError(
            400,
            "return_token_ids cannot show a prompt sent as prompt_embeds: it has no token ids",
            param="return_token_ids",
        )


def _refuse_unserved_chat(request: ChatCompletionRequest) -> None:
    final = request.messages[-1].role
    if request.continue_final_message and _or(request.add_generation_prompt, True):
        raise RequestError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true: set "
            "add_generation_prompt to false to continue the final message",
            param="continue_final_message",
        )
    if request.continue_final_message and final != "assistant":
        raise RequestError(
            400,
            f"continue_final_message continues a final assistant message, but the last "
            f"message is the {final}'s",
            param="continue_final_message",
        )


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
