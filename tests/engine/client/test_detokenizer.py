"""IncrementalDetokenizer against tokenizer.decode (real SmolLM2 tokenizer) and StopChecker."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from trillm.default_model import default_model_dir
from trillm.engine.client.outputs._detokenizer import IncrementalDetokenizer, StopChecker


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir(progress=False) / "tokenizer.json"))


@functools.cache
def _partial_ids() -> list[int]:
    """Tokens whose bytes are not whole UTF-8 characters (pieces of emoji, CJK, ...)."""
    tokenizer = _tokenizer()
    return [
        i
        for i in range(tokenizer.get_vocab_size())
        if "\ufffd" in tokenizer.decode([i], skip_special_tokens=False)
    ]


@pytest.fixture
def tokenizer() -> Tokenizer:
    return _tokenizer()


def _encode(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False).ids)


def _stream(
    ids: Sequence[int], chunks: Sequence[int], prompt: Sequence[int] = (), skip: bool = True
) -> list[str]:
    """Push `ids` in chunks of the given sizes (then one by one); the pieces, then flush."""
    detokenizer = IncrementalDetokenizer(_tokenizer(), prompt, skip_special_tokens=skip)
    pieces, start = [], 0
    sizes = iter(chunks)
    while start < len(ids):
        size = next(sizes, 1)
        pieces.append(detokenizer.push(ids[start : start + size]))
        start += size
    pieces.append(detokenizer.flush())
    return pieces


# -- IncrementalDetokenizer ---------------------------------------------------------------

_VOCAB = 49152
_token_id = st.one_of(
    st.integers(0, _VOCAB - 1),
    st.integers(0, 16),  # special tokens
    st.builds(lambda i: _partial_ids()[i % len(_partial_ids())], st.integers(0, 10**6)),
)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(_token_id, max_size=16),
    prompt=st.lists(_token_id, max_size=8),
    chunks=st.lists(st.integers(1, 3), max_size=16),
    skip=st.booleans(),
)
def test_matches_decode_on_random_tokens(
    ids: list[int], prompt: list[int], chunks: list[int], skip: bool
) -> None:
    expected = _tokenizer().decode(ids, skip_special_tokens=skip)
    pieces = _stream(ids, chunks, prompt, skip)
    assert "".join(pieces) == expected
    streamed = ""
    for piece in pieces:  # never retracts: every prefix of the stream is final
        streamed += piece
        assert expected.startswith(streamed)


_text = st.text(
    st.one_of(
        st.sampled_from(list("aé€😀你好👍🏽 \n")),
        st.characters(
            codec="utf-8", exclude_categories=("Cs", "Cn", "Co"), exclude_characters="\ufffd"
        ),
    ),
    max_size=24,
)


@settings(max_examples=200, deadline=None)
@given(text=_text, prompt=_text)
def test_text_streams_without_replacement_characters(text: str, prompt: str) -> None:
    ids = _encode(text)
    pieces = _stream(ids, (), _encode(prompt))
    assert "".join(pieces) == _tokenizer().decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_emoji_split_across_tokens_is_held_until_complete() -> None:
    ids = _encode("Hello 😀")
    assert len(ids) == 3  # "Hello", " " + 3 bytes of 😀, its last byte
    assert _tokenizer().decode(ids[:2]) == "Hello \ufffd"
    assert _stream(ids, ()) == ["Hello", "", " 😀", ""]


def test_flush_releases_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = _encode("Hello 😀")[:2]
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.push([i]) for i in ids] == ["Hello", ""]
    assert detokenizer.num_held_tokens == 1
    assert detokenizer.flush() == " \ufffd"
    with pytest.raises(
        RuntimeError, match=re.escape("push after flush: the request's output is over")
    ):
        detokenizer.push(ids)


def test_several_tokens_in_one_push(tokenizer: Tokenizer) -> None:
    ids = _encode("你好, world 👍🏽!")
    detokenizer = IncrementalDetokenizer(tokenizer, _encode("Say hi:"))
    assert detokenizer.push(ids) + detokenizer.flush() == "你好, world 👍🏽!"


def test_prompt_context_keeps_the_leading_space(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, _encode("The cat"))
    assert detokenizer.push(_encode(" sat")) == " sat"


def test_prompt_ending_mid_character(tokenizer: Tokenizer) -> None:
    ids = _encode("Hello 😀")
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:2])
    # The output alone is a lone continuation byte: decoded on its own, as decode() does.
    assert detokenizer.push(ids[2:]) + detokenizer.flush() == tokenizer.decode(ids[2:])


@pytest.mark.parametrize(
    ("skip", "expected"),
    [(True, "assistant\nHi!"), (False, "<|im_start|>assistant\nHi!<|im_end|>")],
)
def test_special_tokens(skip: bool, expected: str) -> None:
    ids = _encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert "".join(_stream(ids, (), skip=skip)) == expected


def test_transformers_backend_tokenizer() -> None:
    from transformers import PreTrainedTokenizerFast

    path = default_model_dir(progress=False) / "tokenizer.json"
    backend = PreTrainedTokenizerFast(tokenizer_file=str(path)).backend_tokenizer
    detokenizer = IncrementalDetokenizer(backend, [1])
    assert "".join(detokenizer.push([i]) for i in _encode("¡Olé 😀!")) == "¡Olé 😀!"


# -- StopChecker --------------------------------------------------------------------------


def _feed_all(checker: StopChecker, pieces: Sequence[str]) -> list[tuple[str, bool]]:
    return [checker.feed(piece) for piece in pieces]


def test_stop_string_across_token_boundaries() -> None:
    checker = StopChecker(["\nUser:"])
    results = _feed_all(checker, ["Hello", "\nU", "ser", ":", " more"])
    assert results == [("Hello", False), ("", False), ("", False), ("", True), ("", True)]
    assert checker.stop_string == "\nUser:"
    assert checker.flush() == ""


def test_held_prefix_released_when_it_is_not_a_stop_string() -> None:
    checker = StopChecker(["\nUser:"])
    assert checker.feed("a\nU") == ("a", False)
    assert checker.held_text == "\nU"
    assert checker.feed("se") == ("", False)
    assert checker.feed("d to") == ("\nUsed to", False)
    assert checker.stop_string is None


def test_include_stop_str_in_output() -> None:
    checker = StopChecker(["\nUser:"], True)
    assert _feed_all(checker, ["Hi\nUs", "er: bye"]) == [("Hi", False), ("\nUser:", True)]


def test_nothing_after_the_stop_string() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("fooSTOPbar") == ("foo", True)
    assert checker.feed("baz") == ("", True)
    assert checker.flush() == ""


def test_first_stop_string_to_complete_wins() -> None:
    # "b" completes (after "ab") before "abc" could: token by token, generation stops there.
    checker = StopChecker(["abc", "b"])
    assert _feed_all(checker, ["a", "b", "c"]) == [("", False), ("a", True), ("", True)]
    assert checker.stop_string == "b"


def test_stop_string_that_is_a_prefix_of_another() -> None:
    checker = StopChecker(["User:", "User"], True)
    assert _feed_all(checker, ["Us", "er:"]) == [("", False), ("User", True)]
    assert checker.stop_string == "User"


def test_stop_strings_ending_together_prefer_the_longest() -> None:
    checker = StopChecker(["bc", "abc"])
    assert checker.feed("xabcd") == ("x", True)
    assert checker.stop_string == "abc"


def test_flush_releases_held_text() -> None:
    checker = StopChecker(["###"])
    assert checker.feed("abc#") == ("abc", False)
    assert checker.feed("#") == ("", False)
    assert checker.flush() == "##"
    assert checker.held_text == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^stop strings must not be empty$"):
        StopChecker(["x", ""])


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """Reference: the match ending first in `text`, the longest of those; (start, end, stop)."""
    best: tuple[int, int, str] | None = None
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text.endswith(stop, 0, end):
                return end - len(stop), end, stop
    return best


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("ab\nU:", max_size=30),
    stops=st.lists(st.text("ab\nU:", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_stop_checker_matches_reference(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    match = _first_stop(text, stops)
    expected = text if match is None else text[: match[1] if include else match[0]]

    checker = StopChecker(stops, include)
    emitted, stopped_at = "", None
    for i, piece in enumerate(pieces):
        out, stopped = checker.feed(piece)
        emitted += out
        assert expected.startswith(emitted)  # never emits what a stop string later cuts
        assert len(checker.held_text) < max(map(len, stops))
        if stopped and stopped_at is None:
            stopped_at = i
    if match is None:
        assert stopped_at is None and checker.stop_string is None
        emitted += checker.flush()
    else:
        assert checker.stop_string == match[2]
        # The stop is reported with the piece holding the match's last character.
        assert stopped_at is not None and sum(map(len, pieces[: stopped_at + 1])) >= match[1]
        assert sum(map(len, pieces[:stopped_at])) < match[1]
    assert emitted == expected
