"""`--speculative-config` parsing: vLLM's field names, errors that name the field."""

from __future__ import annotations

import pytest

from trillm.common.speculative import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
)


def test_ngram_with_vllm_s_defaults() -> None:
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config == SpeculativeConfig("ngram", 3, 5, 5)
    one = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert one is not None and (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    assert one.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE


def test_draft_model_and_the_batch_size_bound() -> None:
    config = parse_speculative_config(
        '{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, '
        '"disable_by_batch_size": 4}'
    )
    assert config == SpeculativeConfig("draft_model", 2, model="/m", disable_by_batch_size=4)
    assert config.speculates(4) and not config.speculates(5)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must be"),
        ('{"method": "ngram", "num_speculative_tokens": "2"}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown field 'k'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            r"prompt_lookup_max \(2\) must be >= prompt_lookup_min \(4\)",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model is required"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
            "disable_by_batch_size must be >= 1",
        ),
    ],
)
def test_a_bad_config_names_the_field(text: str, message: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=message):
        parse_speculative_config(text)
