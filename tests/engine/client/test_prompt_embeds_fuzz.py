"""`PromptEmbeds.from_safetensors` and the HTTP edge's base64 decoding never raise anything
but `PromptEmbedsError`, whatever the blob (hypothesis), and the red team's four blobs that
were 500s are 400s naming the problem."""

from __future__ import annotations

import base64
import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.engine.client import PromptEmbeds, PromptEmbedsError
from trillm.http.turn._inputs import decode_prompt_embeds

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def raw(header: bytes, data: bytes = b"", size: int | None = None) -> bytes:
    return (len(header) if size is None else size).to_bytes(8, "little") + header + data


def parse(blob: bytes) -> None:
    with contextlib.suppress(PromptEmbedsError):
        PromptEmbeds.from_safetensors(blob)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)
dimension = st.one_of(
    st.integers(min_value=-2, max_value=2**63), st.booleans(), st.floats(), st.text(max_size=3)
)
tensor_info = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "F64", "", "f32"]) | json_values,
        "shape": st.lists(dimension, max_size=5) | json_values,
        "data_offsets": st.lists(dimension, max_size=3) | json_values,
    }
)
header = st.dictionaries(
    st.text(max_size=6), tensor_info | json_values, max_size=3
) | json_values.map(lambda v: {"t": v})


@SETTINGS
@given(st.binary(max_size=256))
def test_any_bytes_are_parsed_or_refused(blob: bytes) -> None:
    parse(blob)


@SETTINGS
@given(header, st.binary(max_size=64), st.none() | st.integers(min_value=0, max_value=2**64 - 1))
def test_any_header_is_parsed_or_refused(fields: Any, data: bytes, size: int | None) -> None:
    parse(raw(json.dumps(fields).encode(), data, size))


@SETTINGS
@given(st.text(max_size=64))
def test_any_text_at_the_edge_is_decoded_or_refused(text: str) -> None:
    with contextlib.suppress(PromptEmbedsError):
        decode_prompt_embeds(text)


@SETTINGS
@given(header, st.binary(max_size=64))
def test_any_base64_header_at_the_edge_is_decoded_or_refused(fields: Any, data: bytes) -> None:
    text = base64.b64encode(raw(json.dumps(fields).encode(), data)).decode()
    with contextlib.suppress(PromptEmbedsError):
        decode_prompt_embeds(text)


def tensor(shape: str, offsets: str = "[0, 4]") -> bytes:
    text = f'{{"x": {{"dtype": "F32", "shape": {shape}, "data_offsets": {offsets}}}}}'
    return raw(text.encode(), b"\0\0\0\0")


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (tensor("[1, 4611686018427387904]", "[0, 0]"), r"a dimension over 2147483648"),
        (tensor("[0, 4611686018427387904]", "[0, 0]"), "with at least one token"),
        (raw(b"[" * 30000 + b"]" * 30000), "its header is nested too deep"),
        (tensor("[" + "9" * 5000 + ", 1]"), r"its header: Exceeds the limit \(4300 digits\)"),
        (tensor("[true, 1]"), r"has shape \[True, 1\] .*lists of non-negative integers"),
        (tensor("[1, 1, 1, 1, 1, 1, 1, 1]"), r"shape \[tokens, hidden\]"),
    ],
)
def test_the_red_teams_blobs_are_refused_naming_the_problem(blob: bytes, message: str) -> None:
    with pytest.raises(PromptEmbedsError, match=message):
        PromptEmbeds.from_safetensors(blob)
