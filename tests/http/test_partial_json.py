"""A cut-off JSON text's value: every prefix of a JSON text parses to what it had reached."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from trillm.http.turn._partial_json import parse_partial

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def test_a_cut_object_keeps_its_whole_members_and_its_open_string() -> None:
    assert parse_partial('{"city": "Os') == {"city": "Os"}
    assert parse_partial('{"a": 1, "b": ') == {"a": 1}
    assert parse_partial('{"a": {"b": [1, 2') == {"a": {"b": [1, 2]}}
    assert parse_partial('{"a": "x\\') == {"a": "x"}  # an escape cut in half
    assert parse_partial('{"a": tru') == {}
    assert parse_partial("") is None


@given(st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=5), st.data())
def test_every_prefix_of_an_object_parses_to_an_object(value: dict[str, Any], data: Any) -> None:
    text = json.dumps(value, ensure_ascii=data.draw(st.booleans()))
    assert parse_partial(text) == value
    cut = data.draw(st.integers(1, len(text)))
    partial = parse_partial(text[:cut])
    assert isinstance(partial, dict)
    assert set(partial) <= set(value)  # never a member that was not there
