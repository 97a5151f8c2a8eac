"""The frontend's tokenizer loader (torch-free) against transformers' AutoTokenizer (the
oracle): the same ids, the same text, the same chat prompt, for a model directory and a GGUF
file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trillm.default_model import default_model_dir, find_default_gguf
from trillm.engine.client.inputs._tokenizer import (
    gguf_tokenizer_dir,
    load_tokenizer,
    tokenizer_class,
)

TEXTS = ["hello world", " leading space, émoji 🙂 and\ttabs\n", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def same_as_auto(ours: object, oracle: object) -> None:
    for text in TEXTS:
        ids = oracle.encode(text)  # type: ignore[attr-defined]
        assert ours.encode(text) == ids  # type: ignore[attr-defined]
        assert ours.decode(ids) == oracle.decode(ids)  # type: ignore[attr-defined]
    prompt = dict(tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT, **prompt) == oracle.apply_chat_template(CHAT, **prompt)  # type: ignore[attr-defined]
    assert ours.eos_token_id == oracle.eos_token_id  # type: ignore[attr-defined]


def test_a_model_directory_loads_as_autotokenizer_does() -> None:
    model = default_model_dir(progress=False)
    same_as_auto(load_tokenizer(str(model)), AutoTokenizer.from_pretrained(model))


def test_a_gguf_files_tokenizer_is_rebuilt_once_in_a_child(tmp_path: Path) -> None:
    gguf = find_default_gguf()
    saved = gguf_tokenizer_dir(gguf, tmp_path)
    assert (saved / "tokenizer.json").is_file()
    assert gguf_tokenizer_dir(gguf, tmp_path) == saved  # cached: no second child
    oracle = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    same_as_auto(PreTrainedTokenizerFast.from_pretrained(saved), oracle)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"tokenizer_class": "PreTrainedTokenizerFast"}, "TokenizersBackend"),
        ({"tokenizer_class": "Qwen2TokenizerFast"}, "Qwen2Tokenizer"),
        ({"tokenizer_class": "NoSuchTokenizer"}, "TokenizersBackend"),
        ({}, "TokenizersBackend"),
    ],
)
def test_the_class_is_the_named_fast_one_else_the_generic_one(
    tmp_path: Path, config: dict[str, str], expected: str
) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_class(tmp_path).__name__ == expected
