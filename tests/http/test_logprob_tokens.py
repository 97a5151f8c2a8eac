"""Logprobs show each token's decoded text and its bytes, served (issue 27, fault 3): the
oracle is the tokenizer's own decoding of each token id, got with vLLM's
`return_tokens_as_token_ids` from the same greedy request."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from .conftest import Server

ASK = [{"role": "user", "content": "Say something in French, with accents and emoji."}]
LOGPROBS = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "seed": 1}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> object:
    return AutoTokenizer.from_pretrained(tiny_model)


def chat(server: Server, **fields: object) -> dict[str, object]:
    body = {"messages": ASK, "logprobs": True, "top_logprobs": 2, **LOGPROBS, **fields}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def test_chat_logprobs_are_decoded_text_with_their_bytes(server: Server, tokenizer: object) -> None:
    shown = chat(server)["logprobs"]["content"]  # type: ignore[index]
    as_ids = chat(server, return_tokens_as_token_ids=True)["logprobs"]["content"]  # type: ignore[index]
    assert len(shown) == len(as_ids) == LOGPROBS["max_tokens"]
    for entry, by_id in zip(shown, as_ids, strict=True):
        assert by_id["token"].startswith("token_id:")
        token_id = int(by_id["token"].removeprefix("token_id:"))
        assert by_id["bytes"] == entry["bytes"]
        text = tokenizer.decode([token_id])  # type: ignore[attr-defined]
        if "\ufffd" not in text and token_id not in tokenizer.all_special_ids:  # type: ignore[attr-defined]
            assert (entry["token"], bytes(entry["bytes"])) == (text, text.encode())
        for top in entry["top_logprobs"]:
            assert bytes(top["bytes"]).decode("utf-8", "replace") == top["token"]


def test_completion_offsets_count_the_texts_characters(server: Server, tokenizer: object) -> None:
    body = {"prompt": "Café au lait 🙂 is", "logprobs": 1, **LOGPROBS}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    logprobs = choice["logprobs"]
    by_id = {**body, "return_tokens_as_token_ids": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=by_id, timeout=60)
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert len(ids) == len(logprobs["tokens"]) == LOGPROBS["max_tokens"]
    if set(ids) & set(tokenizer.all_special_ids):  # type: ignore[attr-defined]
        pytest.skip("the tiny model wrote a special token, which the text leaves out")
    assert tokenizer.decode(ids) == choice["text"]  # type: ignore[attr-defined]
    for i, offset in enumerate(logprobs["text_offset"]):
        before = tokenizer.decode(ids[:i])  # type: ignore[attr-defined]
        if "\ufffd" not in before:  # (mid-character, the decoded prefix is not the text's)
            assert offset == len(before), (i, before)
