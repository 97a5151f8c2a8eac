"""SamplingParams: every validation rule word for word, and the conversion to SamplingOptions."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
import pytest

from trillm.engine.client.inputs._sampling_params import SamplingParams, SamplingParamsError
from trillm.gpu import SamplingOptions

VOCAB = 49152


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"n": 0}, "n", "n must be between 1 and 128, got 0"),
        ({"n": 129}, "n", "n must be between 1 and 128, got 129"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 20}, "min_tokens", "min_tokens must be <= max_tokens (16), got 20"),
        ({"logprobs": 21}, "logprobs", "logprobs must be between 0 and 20, got 21"),
        ({"logprobs": -1}, "logprobs", "logprobs must be between 0 and 20, got -1"),
        (
            {"prompt_logprobs": 21},
            "prompt_logprobs",
            "prompt_logprobs must be between 0 and 20, got 21",
        ),
        ({"temperature": -1.0}, "temperature", "temperature must be >= 0, got -1.0"),
        ({"temperature": math.inf}, "temperature", "temperature must be finite, got inf"),
        ({"top_p": math.nan}, "top_p", "top_p must be finite, got nan"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k", "top_k must be -1, 0 (off) or >= 1, got -2"),
        ({"min_p": -0.1}, "min_p", "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p", "min_p must be in [0, 1], got 1.1"),
        (
            {"presence_penalty": 3.0},
            "presence_penalty",
            "presence_penalty must be in [-2, 2], got 3.0",
        ),
        (
            {"frequency_penalty": -2.5},
            "frequency_penalty",
            "frequency_penalty must be in [-2, 2], got -2.5",
        ),
        (
            {"repetition_penalty": 0.0},
            "repetition_penalty",
            "repetition_penalty must be in [0.001, 1000], got 0.0",
        ),
        (
            {"repetition_penalty": 1e-38},
            "repetition_penalty",
            "repetition_penalty must be in [0.001, 1000], got 1e-38",
        ),
        ({"temperature": 3.5e38}, "temperature", "temperature must be <= 100, got 3.5e+38"),
        (
            {"logit_bias": {i: 1.0 for i in range(1025)}},
            "logit_bias",
            "the number of logit_bias entries must be <= 1024, got 1025",
        ),
        (
            {"stop_token_ids": list(range(1025))},
            "stop_token_ids",
            "the number of stop_token_ids must be <= 1024, got 1025",
        ),
        ({"seed": -1}, "seed", "seed must be in [0, 2**63), got -1"),
        ({"cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string, or left out"),
        (
            {"cache_salt": "s" * 4097},
            "cache_salt",
            "cache_salt must be at most 4096 characters, got 4097",
        ),
        ({"seed": 2**63}, "seed", f"seed must be in [0, 2**63), got {2**63}"),
        (
            {"logit_bias": {5: 150.0}},
            "logit_bias",
            "logit_bias values must be in [-100, 100], got 150.0 for token 5",
        ),
        (
            {"logit_bias": {5: math.nan}},
            "logit_bias",
            "logit_bias values must be in [-100, 100], got nan for token 5",
        ),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", "logit_bias token ids must be >= 0, got -1"),
        ({"stop_token_ids": [2, -1]}, "stop_token_ids", "stop_token_ids must be >= 0, got -1"),
        ({"stop": ""}, "stop", "stop strings must not be empty"),
        ({"stop": ["a", ""]}, "stop", "stop strings must not be empty"),
        (
            {"stop": [str(i) for i in range(65)]},
            "stop",
            "the number of stop strings must be <= 64, got 65",
        ),
        (
            {"stop": ["x" * 1025]},
            "stop",
            "stop strings must be at most 1024 characters, got one of 1025",
        ),
    ],
)
def test_validation_rule(kwargs: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(SamplingParamsError, match=f"^{re.escape(message)}$") as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_limits_themselves_are_valid() -> None:
    SamplingParams(
        n=128,
        max_tokens=1,
        min_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        logit_bias={0: -100.0, 1: 100.0, **{i: 0.0 for i in range(2, 1024)}},
        seed=2**63 - 1,
        stop=["x" * 1024] + [str(i) for i in range(63)],
        stop_token_ids=[0],
        logprobs=20,
        prompt_logprobs=0,
    )


def test_error_carries_the_value() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(temperature=-1.0)
    assert info.value.value == -1.0


def test_max_tokens_none_lifts_the_min_tokens_bound() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_top_k_minus_one_means_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        SamplingParams().n = 2  # type: ignore[misc]


def test_validation_runs_when_msgspec_decodes() -> None:
    params = msgspec.json.decode(b'{"logit_bias": {"5": 1.5}, "stop": "x"}', type=SamplingParams)
    assert params.logit_bias == {5: 1.5}
    with pytest.raises(msgspec.ValidationError, match=re.escape("top_p must be in (0, 1], got 0")):
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)


@pytest.mark.parametrize(
    ("stop", "strings"),
    [(None, ()), ("x", ("x",)), (["a", "b", "a"], ("a", "b")), ([], ())],
)
def test_stop_strings(stop: str | list[str] | None, strings: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop_strings == strings


def test_default_options() -> None:
    assert SamplingParams().to_options(vocab_size=VOCAB) == SamplingOptions()


def test_options_carry_every_field() -> None:
    params = SamplingParams(
        min_tokens=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={7: -5, 9: 2.5},
        seed=42,
        stop_token_ids=[2, 0],
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=0,
    )
    assert params.to_options(vocab_size=VOCAB) == SamplingOptions(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=42,
        logit_bias=((7, -5.0), (9, 2.5)),
        min_tokens=3,
        stop_token_ids=(2, 0),
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=0,
    )


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=5, min_p=0.1, seed=3)
    options = params.to_options(vocab_size=VOCAB)
    assert options.is_greedy
    assert (options.top_p, options.top_k, options.min_p, options.seed) == (1.0, 0, 0.0, 3)


def test_temperature_at_the_threshold_samples() -> None:
    assert SamplingParams(temperature=1e-5).to_options(vocab_size=VOCAB).temperature == 1e-5


def test_logit_bias_id_beyond_the_vocabulary() -> None:
    params = SamplingParams(logit_bias={VOCAB: 1.0})
    message = f"logit_bias token ids must be < vocab_size ({VOCAB}), got {VOCAB}"
    with pytest.raises(SamplingParamsError, match=f"^{re.escape(message)}$") as info:
        params.to_options(vocab_size=VOCAB)
    assert (info.value.field, info.value.value) == ("logit_bias", VOCAB)


def test_check_vocab_names_the_field_the_id_and_the_size() -> None:
    SamplingParams(logit_bias={VOCAB - 1: 1.0}, stop_token_ids=[VOCAB - 1]).check_vocab(VOCAB)
    message = f"stop_token_ids must be < vocab_size ({VOCAB}), got {2**40}"
    with pytest.raises(SamplingParamsError, match=f"^{re.escape(message)}$") as info:
        SamplingParams(stop_token_ids=[3, 2**40]).check_vocab(VOCAB)
    assert (info.value.field, info.value.value) == ("stop_token_ids", 2**40)


def test_limits_at_the_top_are_valid() -> None:
    SamplingParams(temperature=100.0, repetition_penalty=1000.0, stop_token_ids=list(range(1024)))


def test_stop_token_id_beyond_the_vocabulary() -> None:
    params = SamplingParams(stop_token_ids=[1, 50000])
    message = f"stop_token_ids must be < vocab_size ({VOCAB}), got 50000"
    with pytest.raises(SamplingParamsError, match=f"^{re.escape(message)}$"):
        params.child_options(0, vocab_size=VOCAB)


def test_child_options_derive_seeds() -> None:
    params = SamplingParams(n=3, seed=7)
    seeds = [params.child_options(i, vocab_size=VOCAB).seed for i in range(3)]
    assert seeds == [7, 8, 9]
    assert params.child_options(0, vocab_size=VOCAB) == params.to_options(vocab_size=VOCAB)


def test_child_seed_wraps_below_the_limit() -> None:
    params = SamplingParams(n=2, seed=2**63 - 1)
    assert params.child_options(1, vocab_size=VOCAB).seed == 0


def test_unseeded_children_stay_unseeded() -> None:
    params = SamplingParams(n=2, temperature=0.5)
    children = [params.child_options(i, vocab_size=VOCAB) for i in range(2)]
    assert children == [params.to_options(vocab_size=VOCAB)] * 2
    assert children[0].seed is None


@pytest.mark.parametrize("index", [-1, 2])
def test_child_index_out_of_range(index: int) -> None:
    with pytest.raises(
        IndexError, match=re.escape(f"child index must be in [0, 2) (n), got {index}")
    ):
        SamplingParams(n=2).child_options(index, vocab_size=VOCAB)
