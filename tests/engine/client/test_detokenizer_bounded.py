"""IncrementalDetokenizer on output that never completes a character: a bounded window.

Lone UTF-8 continuation bytes (SmolLM2's token 218 is the byte 0x80) are what a client gets
with `logit_bias {"218": 100}`; `DecodeStream` alone held all of them, decoding the whole
run at every token (4,000 of them: 2 s, against 4 ms for plain tokens).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from trillm.default_model import default_model_dir
from trillm.engine.client.outputs._detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer

LONE_BYTE = 218  # 0x80, a continuation byte: U+FFFD wherever it stands
N = 4000
SEGMENT = 40  # pushes timed together


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir(progress=False) / "tokenizer.json"))


@functools.cache
def _byte_tokens() -> dict[int, int]:
    """Byte -> the token of that one byte (GPT-2's byte-to-character table); bytes that
    never occur in UTF-8 (0xc0, 0xc1, 0xf5...) have none."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    vocab = _tokenizer().get_vocab()
    return {b: vocab[c] for b, c in chars.items() if c in vocab}


@functools.cache
def _partial_ids() -> list[int]:
    tokenizer = _tokenizer()
    return [
        i
        for i in range(tokenizer.get_vocab_size())
        if "\ufffd" in tokenizer.decode([i], skip_special_tokens=False)
    ]


def _bytes(data: bytes) -> list[int]:
    return [_byte_tokens()[b] for b in data]


def _encode(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False).ids)


def _pieces(ids: Sequence[int], prompt: Sequence[int] = (), skip: bool = True) -> list[str]:
    """Push `ids` one by one, then flush; asserts the window stays bounded."""
    detokenizer = IncrementalDetokenizer(_tokenizer(), prompt, skip_special_tokens=skip)
    pieces = []
    for token_id in ids:
        pieces.append(detokenizer.push([token_id]))
        assert detokenizer.num_held_tokens <= MAX_HELD_TOKENS
    return [*pieces, detokenizer.flush()]


def _push_costs(token_id: int, other_id: int) -> tuple[list[float], list[float]]:
    """N pushes of each token into its own detokenizer, timed in alternating segments."""
    prompt = _encode("Write:")
    first = IncrementalDetokenizer(_tokenizer(), prompt)
    second = IncrementalDetokenizer(_tokenizer(), prompt)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(N // SEGMENT):
        for detokenizer, token, out in ((first, token_id, times[0]), (second, other_id, times[1])):
            started = time.perf_counter()
            for _ in range(SEGMENT):
                detokenizer.push([token])
            out.append(time.perf_counter() - started)
    return times


def test_lone_bytes_cost_within_5x_of_plain_tokens() -> None:
    # Segments alternate, and the medians compare: a busy other core slows some segments of
    # both kinds, not the typical one. About 2x on a quiet machine; unbounded, it was 400x.
    plain, lone = _push_costs(_encode(" the")[0], LONE_BYTE)
    ratio = statistics.median(lone) / statistics.median(plain)
    assert ratio < 5, f"{ratio:.1f}x: {sum(lone):.4f} s against {sum(plain):.4f} s"


def test_lone_bytes_decode_as_the_full_decode() -> None:
    ids = [LONE_BYTE] * N
    assert "".join(_pieces(ids, _encode("Write:"))) == _tokenizer().decode(ids) == "\ufffd" * N


def test_text_streams_out_after_a_settle() -> None:
    ids = [LONE_BYTE] * 20 + _encode(" then 😀 and 你好, done")
    pieces = _pieces(ids)
    assert "".join(pieces) == "\ufffd" * 20 + " then 😀 and 你好, done"
    assert pieces[-2:] == [" done", ""]  # streamed, not held to the end


def test_a_started_character_stays_held_across_a_settle() -> None:
    emoji = _bytes("😀".encode())
    for at in range(1, 4):  # the settle falls after 1, 2 or 3 of its 4 bytes
        ids = [LONE_BYTE] * (MAX_HELD_TOKENS + 1 - at) + emoji + _encode("!")
        assert "".join(_pieces(ids)) == "\ufffd" * (MAX_HELD_TOKENS + 1 - at) + "😀!"


def test_a_character_split_by_skipped_special_tokens() -> None:
    ids = [*_bytes(b"\xf0\x9f"), *[0] * (MAX_HELD_TOKENS - 2), *_bytes(b"\x98\x80"), *_encode("!")]
    expected = _tokenizer().decode(ids)
    assert expected == "😀!" and "".join(_pieces(ids)) == expected


def test_skipped_special_tokens_do_not_hold_the_window() -> None:
    pieces = _pieces([0] * 50 + _encode(" ok"), _encode("Say"))
    assert "".join(pieces) == " ok"


def test_flush_after_a_settle_releases_the_rest() -> None:
    detokenizer = IncrementalDetokenizer(_tokenizer(), [])
    text = "".join(detokenizer.push([LONE_BYTE]) for _ in range(30))
    assert detokenizer.num_held_tokens >= 1
    assert text + detokenizer.flush() == "\ufffd" * 30


def test_plain_text_chunks_as_decode_stream_does() -> None:
    # Below the bound nothing changed: the same pieces as tokenizers' own stream.
    ids = _encode("Hello 😀, 你好! " * 20 + "é€👍🏽 done")
    stream = DecodeStream(skip_special_tokens=True)
    expected = [stream.step(_tokenizer(), i) or "" for i in ids]
    assert _pieces(ids)[:-1] == expected


_PIECES = "😀你é".encode() + b"\x80"  # bytes of characters, and a lone one
_token_id = st.one_of(
    st.builds(lambda i: _partial_ids()[i % len(_partial_ids())], st.integers(0, 10**6)),
    st.builds(lambda i: _bytes(_PIECES)[i % len(_PIECES)], st.integers(0, 100)),
    st.integers(0, 16),  # special tokens
    st.integers(0, 49151),
)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(_token_id, max_size=80),
    prompt=st.lists(_token_id, max_size=6),
    chunks=st.lists(st.integers(1, 3), max_size=40),
    skip=st.booleans(),
)
def test_long_runs_match_decode(
    ids: list[int], prompt: list[int], chunks: list[int], skip: bool
) -> None:
    expected = _tokenizer().decode(ids, skip_special_tokens=skip)
    detokenizer = IncrementalDetokenizer(_tokenizer(), prompt, skip_special_tokens=skip)
    streamed, start, sizes = "", 0, iter(chunks)
    while start < len(ids):
        size = next(sizes, 1)
        streamed += detokenizer.push(ids[start : start + size])
        start += size
        assert expected.startswith(streamed)  # never retracts
        assert detokenizer.num_held_tokens <= MAX_HELD_TOKENS + 2
    assert streamed + detokenizer.flush() == expected
