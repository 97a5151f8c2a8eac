"""Request decoding, the mapping to SamplingParams, response shapes (checked with the official
openai SDK's models), SSE framing and error bodies."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from trillm.engine import Output, SamplingParams, TokenLogprob
from trillm.http.edge._errors import (
    RequestError,
    error_body,
    not_found,
    overloaded,
    too_large,
    unauthorized,
)
from trillm.http.openai._schemas import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EchoPrompt,
    ResponseMeta,
    StreamChunker,
    TokenizeRequest,
    chat_completion_chunk,
    chat_completion_response,
    chat_template_messages,
    chat_usage_chunk,
    completion_chunk,
    completion_response,
    decode_request,
    detokenize_response,
    models_response,
    sse,
    to_sampling_params,
    tokenize_response,
    usage,
    version_response,
)

VOCAB = {1: "Hello", 2: " world", 3: "!", 4: " there", 5: "Hi", 6: "é"}


class Pieces:
    """`TokenText` over `VOCAB`: a token's text and its UTF-8 bytes."""

    def __call__(self, token_id: int) -> str:
        return VOCAB[token_id]

    def bytes_of(self, token_id: int) -> bytes:
        return VOCAB[token_id].encode()


token_text = Pieces()


def completion(**fields: Any) -> CompletionRequest:
    return decode_request(json.dumps({"prompt": "Hi", **fields}).encode(), CompletionRequest)


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


@contextmanager
def raises(status: int, message: str, param: str | None) -> Iterator[None]:
    """Expect a RequestError with this status, this message word for word, and this param."""
    with pytest.raises(RequestError, match=f"^{re.escape(message)}$") as info:
        yield
    assert (info.value.status, info.value.param) == (status, param)


# -- decoding ------------------------------------------------------------------------------


def test_unknown_fields_are_ignored() -> None:
    request = completion(functions=[], suffix="x", best_of=3, nested={"a": [1]})
    assert request.prompt == "Hi"


def test_defaults_are_openai_s() -> None:
    request = completion()
    assert (request.max_tokens, request.temperature, request.top_p, request.n) == (16, 1.0, 1, 1)
    assert (request.stream, request.echo, request.logprobs, request.stop) == (
        False,
        False,
        None,
        None,
    )
    assert chat().max_tokens is None and chat().max_completion_tokens is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"prompt": ', "the body is not valid JSON: Input data was truncated"),
        (b"", "the body is not valid JSON: Input data was truncated"),
        (
            b'{"prompt": "a",}',
            "the body is not valid JSON: JSON is malformed: trailing comma in object (byte 15)",
        ),
    ],
)
def test_malformed_json_is_a_400(body: bytes, message: str) -> None:
    with raises(400, message, None):
        decode_request(body, CompletionRequest)


@pytest.mark.parametrize(
    ("body", "kind", "message", "param"),
    [
        (
            {"prompt": "Hi", "max_tokens": "ten"},
            CompletionRequest,
            "invalid max_tokens: expected `int | null`, got `str`",
            "max_tokens",
        ),
        (
            {"prompt": "Hi", "stream": 1},
            CompletionRequest,
            "invalid stream: expected `bool | null`, got `int`",
            "stream",
        ),
        (
            {"prompt": "Hi", "stop": [1]},
            CompletionRequest,
            "invalid stop[0]: expected `str`, got `int`",
            "stop[0]",
        ),
        (
            {"prompt": "Hi", "logit_bias": {"1": "x"}},
            CompletionRequest,
            "invalid logit_bias: expected `float`, got `str`",
            "logit_bias",
        ),
        ({}, CompletionRequest, "prompt is required", "prompt"),
        ({"model": "m"}, ChatCompletionRequest, "messages is required", "messages"),
        (
            {"messages": [{"content": "Hi"}]},
            ChatCompletionRequest,
            "messages[0].role is required",
            "messages[0].role",
        ),
        (
            {"messages": []},
            ChatCompletionRequest,
            "invalid messages: expected `array` of length >= 1",
            "messages",
        ),
        ([1], CompletionRequest, "invalid request body: expected `object`, got `array`", None),
        ({}, DetokenizeRequest, "tokens is required", "tokens"),
    ],
)
def test_a_wrong_type_or_a_missing_field_is_a_400_naming_it(
    body: Any, kind: type[msgspec.Struct], message: str, param: str | None
) -> None:
    with raises(400, message, param):
        decode_request(json.dumps(body).encode(), kind)


def test_nullable_fields_accept_null_as_their_default() -> None:
    params = to_sampling_params(completion(temperature=None, n=None, top_p=None, stop=None))
    assert (params.temperature, params.n, params.top_p, params.stop) == (1.0, 1, 1.0, None)


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Hi", ["Hi"]),
        (["Hi", "there"], ["Hi", "there"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_the_four_prompt_forms(prompt: Any, prompts: list[Any]) -> None:
    assert completion(prompt=prompt).prompts == prompts


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], []], ["a", [1]]])
def test_empty_or_mixed_prompt_lists_are_refused(prompt: Any) -> None:
    message = (
        "prompt must be a string, a list of strings, a non-empty list of token ids, or a list "
        "of non-empty token-id lists"
    )
    with raises(400, message, "prompt"):
        completion(prompt=prompt)


def test_stream_options_need_stream() -> None:
    with raises(400, "stream_options is only allowed when stream is true", "stream_options"):
        completion(stream_options={"include_usage": True})
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True).include_usage


def test_chat_content_parts_are_joined_and_only_text_is_served() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert chat_template_messages(request.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]
    image = {"type": "image_url", "image_url": {"url": "x"}}
    message = "content parts of type 'image_url' are not supported: send 'text' parts"
    with raises(400, message, "messages"):
        chat(messages=[{"role": "user", "content": [image]}])


def test_tokenize_takes_a_prompt_or_messages() -> None:
    request = decode_request(b'{"prompt": "Hi"}', TokenizeRequest)
    assert (request.prompt, request.add_special_tokens) == ("Hi", None)
    for body in (b"{}", b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}'):
        with raises(400, "send either prompt or messages (exactly one)", "prompt"):
            decode_request(body, TokenizeRequest)
    assert decode_request(b'{"tokens": [1, 2]}', DetokenizeRequest).tokens == [1, 2]


# -- to_sampling_params --------------------------------------------------------------------


def test_completion_fields_map_one_to_one() -> None:
    request = completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop=["\n"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        top_k=-1,
        min_p=0.1,
        min_tokens=2,
        seed=42,
        ignore_eos=True,
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        cache_salt="tenant",
    )
    assert to_sampling_params(request) == SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop=["\n"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        top_k=0,
        min_p=0.1,
        min_tokens=2,
        seed=42,
        ignore_eos=True,
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        cache_salt="tenant",
    )


def test_defaults_map_to_the_engine_s_defaults() -> None:
    assert to_sampling_params(completion()) == SamplingParams(max_tokens=16)
    assert to_sampling_params(chat()) == SamplingParams(max_tokens=None)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert to_sampling_params(chat(max_tokens=5)).max_tokens == 5
    assert to_sampling_params(chat(max_tokens=5, max_completion_tokens=9)).max_tokens == 9
    with raises(400, "max_completion_tokens must be >= 1, got 0", "max_completion_tokens"):
        to_sampling_params(chat(max_tokens=5, max_completion_tokens=0))
    with raises(400, "max_tokens must be >= 1, got 0", "max_tokens"):
        to_sampling_params(chat(max_tokens=0))


def test_chat_logprobs_and_top_logprobs() -> None:
    assert to_sampling_params(chat()).logprobs is None
    assert to_sampling_params(chat(logprobs=True)).logprobs == 0
    assert to_sampling_params(chat(logprobs=True, top_logprobs=5)).logprobs == 5
    assert to_sampling_params(chat(logprobs=False, top_logprobs=0)).logprobs is None
    message = "top_logprobs is 3 but logprobs is not true: set logprobs to true to get top logprobs"
    with raises(400, message, "top_logprobs"):
        to_sampling_params(chat(top_logprobs=3))
    with raises(400, "top_logprobs must be between 0 and 20, got 21", "top_logprobs"):
        to_sampling_params(chat(logprobs=True, top_logprobs=21))


def test_completion_logprobs_and_echo() -> None:
    params = to_sampling_params(completion(logprobs=3))
    assert (params.logprobs, params.prompt_logprobs) == (3, None)
    params = to_sampling_params(completion(logprobs=3, echo=True))
    assert (params.logprobs, params.prompt_logprobs) == (3, 3)
    params = to_sampling_params(completion(echo=True))
    assert (params.logprobs, params.prompt_logprobs) == (None, None)
    with raises(400, "logprobs must be between 0 and 20, got 21", "logprobs"):
        to_sampling_params(completion(logprobs=21, echo=True))


def test_logit_bias_keys_are_token_ids_as_strings() -> None:
    params = to_sampling_params(completion(logit_bias={"50256": -100, "7": 2.5}))
    assert params.logit_bias == {50256: -100.0, 7: 2.5}
    message = "logit_bias keys must be token ids (integers), got 'abc'"
    with raises(400, message, "logit_bias"):
        to_sampling_params(completion(logit_bias={"abc": 1}))
    message = "logit_bias values must be in [-100, 100], got 200.0 for token 5"
    with raises(400, message, "logit_bias"):
        to_sampling_params(completion(logit_bias={"5": 200}))


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"n": 0}, "n must be between 1 and 128, got 0", "n"),
        ({"temperature": -1}, "temperature must be >= 0, got -1.0", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0", "top_p"),
        (
            {"presence_penalty": 3},
            "presence_penalty must be in [-2, 2], got 3.0",
            "presence_penalty",
        ),
        ({"seed": -1}, "seed must be in [0, 2**63), got -1", "seed"),
        ({"min_tokens": 20}, "min_tokens must be <= max_tokens (16), got 20", "min_tokens"),
        ({"stop": [""]}, "stop strings must not be empty", "stop"),
        ({"cache_salt": ""}, "cache_salt must be a non-empty string, or left out", "cache_salt"),
    ],
)
def test_out_of_range_values_are_a_400_naming_field_value_and_limit(
    fields: dict[str, Any], message: str, param: str
) -> None:
    with raises(400, message, param):
        to_sampling_params(completion(**fields))


# -- responses -----------------------------------------------------------------------------

COMPLETION_META = ResponseMeta("cmpl-abc", "tiny", 1700000000)
CHAT_META = ResponseMeta("chatcmpl-abc", "tiny", 1700000000)


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, list(top))


def output(index: int = 0, text: str = "Hello world", **fields: Any) -> Output:
    defaults: dict[str, Any] = {
        "token_ids": [1, 2],
        "finish_reason": "length",
        "num_prompt_tokens": 3,
        "num_output_tokens": 2,
    }
    return Output(index, text, **{**defaults, **fields})


def test_ids_name_their_kind() -> None:
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", ResponseMeta.completion("m").id)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", ResponseMeta.chat("m").id)


def test_completion_response_is_openai_s_completion() -> None:
    outputs = [
        output(0, num_cached_tokens=2),
        output(1, "Hi", token_ids=[5], finish_reason="stop", stop_reason=3, num_output_tokens=1),
    ]
    body = completion_response(
        COMPLETION_META, outputs, n=2, token_text=token_text, prompt_tokens_details=True
    )
    parsed = Completion.model_validate_json(body)
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == (
        "cmpl-abc",
        "text_completion",
        1700000000,
        "tiny",
    )
    assert [(c.index, c.text, c.finish_reason, c.logprobs) for c in parsed.choices] == [
        (0, "Hello world", "length", None),
        (1, "Hi", "stop", None),
    ]
    assert parsed.usage is not None
    # The prompt counts once for its n choices.
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (3, 3)
    assert parsed.usage.total_tokens == 6
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2
    assert json.loads(body)["choices"][1]["stop_reason"] == 3


def test_completion_logprobs_include_the_sampled_token_and_offsets() -> None:
    logprobs = [lp(1, -0.5, (1, -0.5), (5, -1.5)), lp(2, -0.25, (3, -0.1))]
    body = completion_response(
        COMPLETION_META, [output(logprobs=logprobs)], n=1, token_text=token_text
    )
    choice = Completion.model_validate_json(body).choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["Hello", " world"]
    assert choice.logprobs.token_logprobs == [-0.5, -0.25]
    assert choice.logprobs.top_logprobs == [
        {"Hello": -0.5, "Hi": -1.5},
        {"!": -0.1, " world": -0.25},
    ]
    assert choice.logprobs.text_offset == [0, 5]


def test_completion_echo_prepends_the_prompt_and_its_logprobs() -> None:
    prompt_logprobs: list[TokenLogprob | None] = [None, lp(4, -2.0, (4, -2.0))]
    out = output(logprobs=[lp(1, -0.5), lp(2, -0.25)], prompt_logprobs=prompt_logprobs)
    echo = [EchoPrompt("Hi there", [5, 4])]
    body = completion_response(COMPLETION_META, [out], n=1, token_text=token_text, echo=echo)
    choice = json.loads(body)["choices"][0]
    assert choice["text"] == "Hi thereHello world"
    assert choice["logprobs"] == {
        "tokens": ["Hi", " there", "Hello", " world"],
        "token_logprobs": [None, -2.0, -0.5, -0.25],
        "top_logprobs": [None, {" there": -2.0}, {"Hello": -0.5}, {" world": -0.25}],
        "text_offset": [0, 2, 8, 13],
    }
    # Without logprobs, only the text is echoed.
    body = completion_response(COMPLETION_META, [output()], n=1, token_text=token_text, echo=echo)
    assert json.loads(body)["choices"][0]["logprobs"] is None


def test_minus_infinity_becomes_vllm_s_floor() -> None:
    out = output(logprobs=[lp(1, float("-inf"), (1, float("-inf")))], token_ids=[1])
    body = chat_completion_response(CHAT_META, [out], n=1, token_text=token_text)
    entry = json.loads(body)["choices"][0]["logprobs"]["content"][0]
    assert (entry["logprob"], entry["top_logprobs"][0]["logprob"]) == (-9999.0, -9999.0)


def test_chat_completion_response_is_openai_s_chat_completion() -> None:
    logprobs = [lp(6, -0.5, (6, -0.5), (5, -1.0)), lp(3, -0.1, (3, -0.1), (1, -3.0))]
    out = output(0, "é!", token_ids=[6, 3], finish_reason="stop", logprobs=logprobs)
    body = chat_completion_response(CHAT_META, [out], n=1, token_text=token_text)
    parsed = ChatCompletion.model_validate_json(body)
    assert (parsed.id, parsed.object, parsed.model) == ("chatcmpl-abc", "chat.completion", "tiny")
    choice = parsed.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        "é!",
        "stop",
    )
    assert choice.logprobs is not None and choice.logprobs.content is not None
    first = choice.logprobs.content[0]
    assert (first.token, first.logprob, first.bytes) == ("é", -0.5, [0xC3, 0xA9])
    assert [(t.token, t.logprob, t.bytes) for t in first.top_logprobs] == [
        ("é", -0.5, [0xC3, 0xA9]),
        ("Hi", -1.0, [72, 105]),
    ]
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (3, 2)


def test_chat_chunks_are_openai_s_chunks() -> None:
    first = chat_completion_chunk(CHAT_META, Output(0, "", []), token_text=token_text, first=True)
    assert json.loads(first)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in json.loads(first)
    middle = chat_completion_chunk(
        CHAT_META, output(text="Hello", finish_reason=None), token_text=token_text
    )
    last = chat_completion_chunk(
        CHAT_META, output(text="", token_ids=[], finish_reason="stop"), token_text=token_text
    )
    for data in (first, middle, last):
        parsed = ChatCompletionChunk.model_validate_json(data)
        assert (parsed.id, parsed.object, parsed.created) == (
            "chatcmpl-abc",
            "chat.completion.chunk",
            1700000000,
        )
    assert json.loads(middle)["choices"][0]["delta"] == {"content": "Hello"}
    assert json.loads(middle)["choices"][0]["finish_reason"] is None
    assert json.loads(last)["choices"][0]["delta"] == {}
    assert json.loads(last)["choices"][0]["finish_reason"] == "stop"


def test_include_usage_gives_null_usage_then_a_usage_chunk() -> None:
    data = chat_completion_chunk(CHAT_META, output(), token_text=token_text, include_usage=True)
    assert json.loads(data)["usage"] is None
    final = ChatCompletionChunk.model_validate_json(chat_usage_chunk(CHAT_META, usage(3, 2, 1)))
    assert final.choices == []
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.total_tokens) == (
        3,
        2,
        5,
    )
    data = completion_chunk(COMPLETION_META, output(), token_text=token_text, include_usage=True)
    assert json.loads(data)["usage"] is None
    assert Completion.model_validate_json(data).choices[0].text == "Hello world"


def test_the_chat_stream_chunker_sends_a_role_chunk_then_deltas_then_usage() -> None:
    chunker = StreamChunker(
        CHAT_META,
        chat=True,
        n=1,
        token_text=token_text,
        include_usage=True,
        prompt_tokens_details=True,
    )
    steps = [
        output(
            text="Hello",
            token_ids=[1],
            finish_reason=None,
            num_output_tokens=1,
            num_cached_tokens=2,
        ),
        output(text="", token_ids=[6], finish_reason=None, num_output_tokens=2),  # held UTF-8
        output(text=" world", token_ids=[2], finish_reason="stop", num_output_tokens=3),
    ]
    chunks = [json.loads(c) for step in steps for c in chunker.chunks(step)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
        {"content": " world"},
    ]
    assert all(c["usage"] is None for c in chunks)
    final = ChatCompletionChunk.model_validate_json(chunker.usage_chunk())
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 3)
    assert final.usage.prompt_tokens_details is not None
    assert final.usage.prompt_tokens_details.cached_tokens == 2


def test_the_completion_stream_chunker_holds_the_echo_for_all_prompt_logprobs() -> None:
    echo = [EchoPrompt("Hi there", [5, 4])]
    chunker = StreamChunker(COMPLETION_META, chat=False, n=1, token_text=token_text, echo=echo)
    prompt_chunk = Output(0, "", [], prompt_logprobs=[None], num_prompt_tokens=2)
    assert chunker.chunks(prompt_chunk) == []
    first = output(
        text="Hello",
        token_ids=[1],
        finish_reason=None,
        logprobs=[lp(1, -0.5)],
        prompt_logprobs=[lp(4, -2.0)],
    )
    second = output(text=" world", token_ids=[2], finish_reason="length", logprobs=[lp(2, -0.25)])
    (a,) = chunker.chunks(first)
    (b,) = chunker.chunks(second)
    assert json.loads(a)["choices"][0]["text"] == "Hi thereHello"
    assert json.loads(a)["choices"][0]["logprobs"]["token_logprobs"] == [None, -2.0, -0.5]
    assert json.loads(a)["choices"][0]["logprobs"]["text_offset"] == [0, 2, 8]
    assert Completion.model_validate_json(b).choices[0].logprobs is not None
    assert json.loads(b)["choices"][0]["text"] == " world"
    assert json.loads(b)["choices"][0]["logprobs"]["text_offset"] == [13]
    assert "usage" not in json.loads(b)
    usage_chunk = Completion.model_validate_json(chunker.usage_chunk())
    assert usage_chunk.choices == [] and usage_chunk.usage is not None


def test_sse_framing() -> None:
    assert sse(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_the_small_responses() -> None:
    models = json.loads(models_response(["tiny"], max_model_len=2048, created=1700000000))
    assert models["object"] == "list"
    card = Model.model_validate(models["data"][0])
    assert (card.id, card.object, card.owned_by, card.created) == (
        "tiny",
        "model",
        "trillm",
        1700000000,
    )
    assert models["data"][0]["max_model_len"] == 2048
    assert models["data"][0]["root"] == "tiny"  # the model it runs, by name unless given
    assert "parent" in models["data"][0] and models["data"][0]["parent"] is None
    rooted = json.loads(models_response(["tiny"], max_model_len=2048, root="org/tiny"))
    assert rooted["data"][0]["root"] == "org/tiny"
    assert json.loads(tokenize_response([1, 2, 3], max_model_len=2048)) == {
        "tokens": [1, 2, 3],
        "count": 3,
        "max_model_len": 2048,
        "token_strs": None,  # vLLM's: null unless return_token_strs
    }
    assert json.loads(detokenize_response("Hi")) == {"prompt": "Hi"}
    assert json.loads(version_response("0.1.0")) == {"version": "0.1.0"}


# -- errors --------------------------------------------------------------------------------


def test_error_bodies_are_openai_s() -> None:
    err = RequestError(400, "n must be between 1 and 128, got 0", param="n")
    assert json.loads(error_body(err)) == {
        "error": {
            "message": "n must be between 1 and 128, got 0",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    }
    assert RequestError(500, "boom").type == "server_error"
    assert RequestError(503, "draining", "server_error").type == "server_error"


def test_error_helpers() -> None:
    err = not_found("the model 'gpt-4'", param="model", code="model_not_found")
    assert (err.status, err.type, err.message) == (
        404,
        "invalid_request_error",
        "the model 'gpt-4' does not exist",
    )
    err = too_large(1024, 4096)
    assert (err.status, err.message) == (
        413,
        "the request body is larger than the limit of 1024 bytes (got 4096 bytes); send a "
        "smaller one",
    )
    err = unauthorized()
    assert (err.status, err.type, err.code) == (401, "authentication_error", "invalid_api_key")
    assert err.headers == {"WWW-Authenticate": "Bearer"}
    err = overloaded(0.2)
    assert (err.status, err.type, err.headers) == (429, "rate_limit_exceeded", {"Retry-After": "1"})
    assert err.message == (
        "the server is overloaded: too many requests are waiting; retry after 1 s"
    )
    assert overloaded(2.5).headers == {"Retry-After": "3"}
