"""`prompt_embeds` on /v1/completions (`--enable-prompt-embeds`): the model's own embedding
rows of a prompt give the same greedy tokens as the prompt's ids (a real oracle), over
chunked prefill too; every bad input is a 400 naming the field."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save

from .conftest import Server, start_server

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(100, 141))  # 41 positions: three chunks of at most 16 tokens


@pytest.fixture(scope="module")
def embeds_server(tiny_model: Path) -> Iterator[Server]:
    args = ("--enable-prompt-embeds", "--max-num-batched-tokens", "16", "--max-model-len", "128")
    server = start_server(tiny_model, *args)
    try:
        yield server
    finally:
        server.stop()


def encoded(values: torch.Tensor, name: str = "embeds") -> str:
    return base64.b64encode(save({name: values.contiguous()})).decode()


def rows_of(model: Path, ids: list[int]) -> torch.Tensor:
    """The model's own embedding rows of `ids` (tied: the head's too)."""
    table = load_file(model / "model.safetensors")["model.embed_tokens.weight"]
    return torch.from_numpy(np.ascontiguousarray(table[ids], np.float32))


def complete(server: Server, **body: Any) -> httpx.Response:
    fields = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
              "return_tokens_as_token_ids": True, **body}  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/completions", json=fields, timeout=120)


def tokens(response: httpx.Response) -> tuple[list[str], str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    (choice,) = body["choices"]
    return choice["logprobs"]["tokens"], choice["text"], body["usage"]["prompt_tokens"]


def test_the_model_s_own_embedding_rows_give_the_prompt_s_greedy_tokens(
    embeds_server: Server, tiny_model: Path
) -> None:
    by_ids = tokens(complete(embeds_server, prompt=PROMPT))
    rows = encoded(rows_of(tiny_model, PROMPT))
    assert tokens(complete(embeds_server, prompt="", prompt_embeds=rows)) == by_ids
    assert tokens(complete(embeds_server, prompt_embeds=[rows])) == by_ids  # no prompt at all
    other = encoded(rows_of(tiny_model, PROMPT[::-1]))
    assert tokens(complete(embeds_server, prompt_embeds=other))[0] != by_ids[0]


def test_bad_embeddings_are_a_400_naming_the_field(embeds_server: Server) -> None:
    hidden = 64
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"prompt_embeds": encoded(torch.zeros(3, 7))}, "prompt_embeds",
         f"prompt_embeds must have shape [tokens, {hidden}] (the model's hidden size), got [3, 7]"),
        ({"prompt_embeds": encoded(torch.zeros(hidden))}, "prompt_embeds",
         "prompt_embeds must have shape [tokens, hidden] with at least one token, got [64]"),
        ({"prompt_embeds": encoded(torch.full((2, hidden), float("nan")))}, "prompt_embeds",
         "prompt_embeds must be finite, got nan at [0, 0]"),
        ({"prompt_embeds": encoded(torch.zeros(2, hidden, dtype=torch.int32))}, "prompt_embeds",
         "prompt_embeds must be float16, bfloat16 or float32 (F16, BF16, F32), got 'I32'"),
        ({"prompt_embeds": "not base64!"}, "prompt_embeds",
         "prompt_embeds must be base64 (of a safetensors file): "),
        ({"prompt_embeds": encoded(torch.zeros(129, hidden))}, "prompt_embeds",
         "prompt_embeds has 129 tokens, more than the model's maximum length 128"),
        ({"prompt_embeds": encoded(torch.zeros(2, hidden)), "prompt": "hi"}, "prompt",
         'send either prompt or prompt_embeds: with prompt_embeds, prompt must be "" or left out'),
        ({"prompt_embeds": encoded(torch.zeros(2, hidden)), "echo": True}, "echo",
         "echo cannot show a prompt sent as prompt_embeds: it has no text"),
        ({"prompt_embeds": []}, "prompt_embeds",
         "prompt_embeds must be a base64 string or a non-empty list of them"),
    ]  # fmt: skip
    for body, param, message in cases:
        response = complete(embeds_server, **body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(message), error


def test_off_by_default_a_400_says_how_to_turn_it_on(server: Server) -> None:
    response = complete(server, prompt="", prompt_embeds=encoded(torch.zeros(2, 64)))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt_embeds"
    assert error["message"].startswith(
        "prompt_embeds is off on this server: start it with --enable-prompt-embeds"
    )
