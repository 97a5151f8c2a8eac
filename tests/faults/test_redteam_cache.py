"""Red-team items 5 and 6 (issue 25) through `trillm serve`: the prefix cache tells no client
about another's prompts, and output that never completes a character streams as cheaply as
text.

5. `usage.prompt_tokens_details.cached_tokens` told a client how much of its prompt another
   had sent: guess 48 of someone's 64 tokens right and get 48 back. It is null unless the
   server runs with `--enable-prompt-tokens-details` (vLLM's flag and default).
6. `logit_bias {"218": 100}` makes SmolLM2's tokenizer emit the lone byte 0x80 forever: held
   as an incomplete character, it made each token cost the frontend's event loop more than
   the last. Now it streams out as U+FFFD as it comes, at a bounded cost per token.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
import trio

from trillm.default_model import default_model_dir

from ..gpu.conftest import TINY
from ..http.conftest import Server
from .http_harness import serving

BLOCK = 16  # the server's default block size
LONE_BYTE = "218"  # SmolLM2's token for the byte 0x80
LONG = 2000  # tokens of the forced stream
# Safety nets, not speed claims: the forced stream took 7 s on 2 quiet cores and 63 s with
# other work on both; the other stream's longest gap 0.15 s (its median 0.03 s) then.
STREAM_BOUND_S = 300.0
GAP_BOUND_S = 2.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of tests/http with room for the forced stream (4,096 positions)."""
    path = tmp_path_factory.mktemp("redteam-tiny")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **{**TINY, "max_position_embeddings": 4096}, tie_word_embeddings=True
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir(progress=False) / name, path / name)
    return path


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    with serving(model) as server:
        yield server


@pytest.fixture(scope="module")
def detailed(model: Path) -> Iterator[Server]:
    with serving(model, "--enable-prompt-tokens-details") as server:
        yield server


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


def _usage(server: Server, path: str, body: dict[str, Any], *, stream: bool = False) -> Any:
    """The raw JSON usage of `body`, answered whole or streamed (its usage chunk)."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        if not stream:
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", path, json=body) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def _completion(prompt: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}


def _chat(text: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}


def _guesses(server: Server, rng: random.Random, *, stream: bool) -> tuple[Any, Any]:
    """Someone sends 64 tokens; a guesser sends their first 48 and 16 others, then another
    guesser a wrong guess (the first token changed). Their usages."""
    secret = _prompt(rng, 4 * BLOCK)
    _usage(server, "/v1/completions", _completion(secret))
    right = [*secret[: 3 * BLOCK], *_prompt(rng, BLOCK)]
    wrong = [secret[0] + 1, *right[1:]]
    return (
        _usage(server, "/v1/completions", _completion(right), stream=stream),
        _usage(server, "/v1/completions", _completion(wrong), stream=stream),
    )


def _chat_again(server: Server, rng: random.Random, *, stream: bool) -> tuple[Any, Any]:
    """The usages of a new chat message, sent, then sent again."""
    body = _chat(f"What does {rng.random()} stand for?")
    first = _usage(server, "/v1/chat/completions", body, stream=stream)
    return first, _usage(server, "/v1/chat/completions", body, stream=stream)


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_absent_by_default(server: Server, stream: bool) -> None:
    rng = random.Random(f"null-{stream}")
    usages = [*_guesses(server, rng, stream=stream), *_chat_again(server, rng, stream=stream)]
    assert [u["prompt_tokens"] for u in usages[:2]] == [4 * BLOCK] * 2
    assert ["prompt_tokens_details" in u for u in usages] == [False] * 4


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_with_enable_prompt_tokens_details(detailed: Server, stream: bool) -> None:
    rng = random.Random(f"detailed-{stream}")
    right, wrong = _guesses(detailed, rng, stream=stream)
    # What the flag gives away: the right guess learns that someone sent those 48 tokens.
    assert right["prompt_tokens_details"] == {"cached_tokens": 3 * BLOCK}
    assert wrong["prompt_tokens_details"] == {"cached_tokens": 0}
    first, again = _chat_again(detailed, rng, stream=stream)
    # The chat template's system prompt is a prefix every chat shares.
    shared = first["prompt_tokens_details"]["cached_tokens"]
    full = (again["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert shared < full
    assert again["prompt_tokens_details"] == {"cached_tokens": full}


async def _stream(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    arrivals: list[tuple[float, str]],
    halfway: trio.Event | None = None,
) -> None:
    """Stream a completion: (time, text) of each chunk that has text; `halfway` is set once
    half of `max_tokens` characters came."""
    count = 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["text"]:
                    arrivals.append((time.monotonic(), choices[0]["text"]))
                    count += len(choices[0]["text"])
                    if halfway is not None and count >= body["max_tokens"] // 2:
                        halfway.set()


def _gaps(arrivals: list[tuple[float, str]]) -> list[float]:
    return [b[0] - a[0] for a, b in itertools.pairwise(arrivals)]


async def test_a_stream_of_lone_bytes_streams_while_another_does(server: Server) -> None:
    forced = {
        "model": "tiny",
        "prompt": "Write:",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {LONE_BYTE: 100},
    }
    plain = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "temperature": 0}
    plain["ignore_eos"] = True
    lone: list[tuple[float, str]] = []
    other: list[tuple[float, str]] = []
    halfway = trio.Event()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=STREAM_BOUND_S) as client:
        started = time.monotonic()
        with trio.fail_after(STREAM_BOUND_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stream, client, forced, lone, halfway)
                await halfway.wait()  # held as incomplete, it would come only at the end
                await _stream(client, plain, other)
        elapsed = time.monotonic() - started
    assert "".join(text for _, text in lone) == "\ufffd" * LONG, elapsed
    # It streamed as it came (held as incomplete, it all came in the last chunk) ...
    assert len(lone) > LONG // 20
    # ... and the other stream kept streaming meanwhile.
    assert len(other) > 100
    assert max(_gaps(other)) < GAP_BOUND_S, statistics.median(_gaps(other))
