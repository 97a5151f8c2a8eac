"""Each token's text and bytes for logprobs, against the tokenizer's own decoding (oracle)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from trillm.default_model import default_model_dir
from trillm.engine.client.outputs._token_pieces import TokenIds, TokenPieces


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(default_model_dir(progress=False))


def test_every_whole_token_is_its_decoded_text(tokenizer: object) -> None:
    pieces = TokenPieces(tokenizer)
    special = set(tokenizer.all_special_ids)  # type: ignore[attr-defined]
    checked = 0
    for token_id in range(len(tokenizer)):  # type: ignore[arg-type]
        text = tokenizer.decode([token_id])  # type: ignore[attr-defined]
        if token_id in special or "\ufffd" in text:
            continue  # a piece of a character: its bytes are checked below
        assert pieces(token_id) == text, token_id
        assert pieces.bytes_of(token_id) == text.encode(), token_id
        checked += 1
    assert checked > 40_000  # SmolLM2's 49,152, less special tokens and character pieces


def test_the_bytes_of_a_texts_tokens_are_the_text(tokenizer: object) -> None:
    pieces = TokenPieces(tokenizer)
    text = "Ünïcode: 🙂 emoji, 中文, tabs\tand\nnewlines, <|im_end|> too"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert b"".join(pieces.bytes_of(i) for i in ids) == text.encode()
    split = [i for i in ids if "\ufffd" in pieces(i)]
    assert split, "the emoji and the Chinese are split across byte tokens here"
    assert {pieces(i) for i in split} == {"\ufffd"}
    space = tokenizer.convert_tokens_to_ids("Ġ")  # type: ignore[attr-defined]
    assert (pieces(space), pieces.bytes_of(space)) == (" ", b" ")


def test_token_ids_show_the_id_and_keep_the_bytes(tokenizer: object) -> None:
    pieces = TokenPieces(tokenizer)
    shown = TokenIds(pieces)
    space = tokenizer.convert_tokens_to_ids("Ġ")  # type: ignore[attr-defined]
    assert (shown(space), shown.bytes_of(space)) == (f"token_id:{space}", b" ")
