"""`nests_deeper`: the nesting of JSON measured on its bytes, against a plain reference."""

from __future__ import annotations

import json
import random

import pytest

from trillm.http.edge._errors import RequestError
from trillm.http.edge._json_depth import MAX_JSON_DEPTH, nests_deeper
from trillm.http.openai._requests import CompletionRequest, decode_request


def reference_depth(text: str) -> int:
    """The nesting depth, by walking the characters (slow, obviously right)."""
    depth = best = 0
    inside = escaped = False
    for char in text:
        if inside:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                inside = False
        elif char == '"':
            inside = True
        elif char in "[{":
            depth += 1
            best = max(best, depth)
        elif char in "]}":
            depth -= 1
    return best


def random_json(rng: random.Random) -> object:
    """Small trees (each node has under one child on average), some inside a long chain."""
    kind = rng.random()
    if kind < 0.3:
        return rng.choice(['a"b', "\\", '\\"[', "{[", "]}", "x\\\\", 'q"', "", "\u00e9["])
    if kind < 0.55:
        return rng.choice([1, -2.5, None, True])
    children = [random_json(rng) for _ in range(rng.randrange(3))]
    value: object = children if kind < 0.8 else {rng.choice(["k", '"', "[{"]): c for c in children}
    for _ in range(rng.choice([0, 0, 0, 5, 100])):  # a chain: depth without width
        value = [value] if rng.random() < 0.5 else {"[": value}
    return value


def test_agrees_with_the_reference_on_random_json() -> None:
    rng = random.Random(7)
    for _ in range(500):
        text = json.dumps(random_json(rng))
        depth = reference_depth(text)
        for limit in (0, 1, depth - 1, depth, depth + 1):
            if limit >= 0:
                assert nests_deeper(text, limit) == (depth > limit), (text, limit)
                assert nests_deeper(text.encode(), limit) == (depth > limit)


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ('{"a": "[[[[[[[[[["}', 1),
        ('{"a": "\\"[[[[[[[["}', 1),  # an escaped quote does not end the string
        ('{"a": "\\\\", "b": [[[]]]}', 4),  # an escaped backslash does not escape the quote
        ("[" * 300 + "]" * 300, 300),
        ('{"a":' * 300 + "1" + "}" * 300, 300),
    ],
)
def test_strings_and_escapes(text: str, depth: int) -> None:
    assert reference_depth(text) == depth
    assert not nests_deeper(text, depth) and nests_deeper(text, depth - 1)


def test_text_that_is_not_json_gets_an_answer() -> None:
    for text in ("]]]]", '"unterminated [[[[', "[[[[", "", "\\"):
        assert nests_deeper(text, 2) in (True, False)


def test_a_deep_body_is_a_400_naming_the_limit() -> None:
    body = b'{"prompt": "a", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    message = (
        f"the request body nests deeper than {MAX_JSON_DEPTH} arrays and objects one inside "
        f"another; flatten it"
    )
    with pytest.raises(RequestError, match=f"^{message}$") as info:
        decode_request(body, CompletionRequest)
    assert (info.value.status, info.value.code) == (400, "too_deep")
    shallow = b'{"prompt": "a", "x": ' + b"[" * 200 + b"]" * 200 + b"}"
    assert decode_request(shallow, CompletionRequest).prompt == "a"
