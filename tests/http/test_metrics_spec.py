"""Speculative decoding on /metrics: vLLM's `vllm:spec_decode_*` counters and our acceptance
rate, from the engine's `stats` utility; and `trillm serve --speculative-config` end to end
(the same greedy text as a server without it, the counters moved by the drafts it verified,
a json_schema response verified with drafts is the same valid JSON).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from trillm.http.metrics._metrics import Metrics

from .conftest import Server, start_server
from .test_metrics_vllm import Samples, aliases_match, samples

NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
    '"prompt_lookup_max": 4}'
)
# Token ids the tiny random model loops on (tests/engine/core/test_spec_decode.py), so that
# lookup proposes drafts and some are accepted.
LOOPING_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 11]]


def spec(found: Samples, name: str, **labels: str) -> float:
    key = tuple(sorted({"model_name": "tiny", "engine": "0", **labels}.items()))
    return found[(name, key)]


def stats(drafts: int, drafted: int, accepted: int, per_pos: list[int]) -> dict[str, object]:
    return {
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "spec_accepted_per_position": per_pos,
    }


def test_the_engine_s_spec_counts_are_exposed_under_vllm_s_names() -> None:
    metrics = Metrics("tiny")
    before = samples(metrics.render().decode())
    assert spec(before, "vllm:spec_decode_num_drafts_total") == 0
    assert (
        "trillm:spec_decode_acceptance_rate",
        (("engine", "0"), ("model_name", "tiny")),
    ) not in before
    metrics.set_engine_stats(stats(4, 12, 7, [4, 2, 1]))
    metrics.set_engine_stats(stats(5, 15, 9, [5, 3, 1]))  # cumulative: moved by the difference
    found = samples(metrics.render().decode())
    aliases_match(found)
    assert spec(found, "vllm:spec_decode_num_drafts_total") == 5
    assert spec(found, "vllm:spec_decode_num_draft_tokens_total") == 15
    assert spec(found, "vllm:spec_decode_num_accepted_tokens_total") == 9
    per_pos = [
        spec(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
        for j in range(3)
    ]
    assert per_pos == [5, 3, 1]
    assert spec(found, "trillm:spec_decode_acceptance_rate") == pytest.approx(9 / 15)
    assert not any(name == "vllm:spec_decode_acceptance_rate" for name, _ in found)


def test_a_restarted_engine_s_counts_are_added_from_zero() -> None:
    metrics = Metrics("tiny")
    metrics.set_engine_stats(stats(5, 15, 9, [5, 3, 1]))
    metrics.set_engine_stats(stats(1, 3, 2, [1, 1, 0]))  # lower: a new engine
    found = samples(metrics.render().decode())
    assert spec(found, "trillm:spec_decode_num_draft_tokens_total") == 18
    assert spec(found, "trillm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 4
    assert spec(found, "trillm:spec_decode_acceptance_rate") == pytest.approx(2 / 3)


# -- real servers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_model: Path) -> Iterator[tuple[Server, Server]]:
    """The tiny model served without speculation and with `--speculative-config` ngram."""
    off = start_server(tiny_model)
    try:
        ngram = start_server(tiny_model, "--speculative-config", NGRAM)
        try:
            yield off, ngram
        finally:
            ngram.stop()
    finally:
        off.stop()


async def completion(client: httpx.AsyncClient, server: Server, prompt: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    response = await client.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


async def test_speculative_config_serves_the_same_greedy_text_and_counts_drafts(
    servers: tuple[Server, Server],
) -> None:
    off, ngram = servers
    async with httpx.AsyncClient() as client:
        for prompt in LOOPING_PROMPTS:
            assert await completion(client, ngram, prompt) == await completion(client, off, prompt)
        found = samples((await client.get(f"{ngram.base_url}/metrics", timeout=30)).text)
        unspeculated = samples((await client.get(f"{off.base_url}/metrics", timeout=30)).text)
    aliases_match(found)
    drafted = spec(found, "vllm:spec_decode_num_draft_tokens_total")
    accepted = spec(found, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert 0 < spec(found, "vllm:spec_decode_num_drafts_total") <= drafted
    per_pos = {
        labels: v
        for (name, labels), v in found.items()
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert sum(per_pos.values()) == accepted
    assert spec(found, "trillm:spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
    assert spec(unspeculated, "vllm:spec_decode_num_draft_tokens_total") == 0


# Repetitive and bounded: the random tiny model must finish it, and lookup finds drafts in it.
SCHEMA = {
    "type": "object",
    "properties": {
        "pets": {
            "type": "array",
            "items": {"type": "string", "enum": ["cat", "dog"]},
            "minItems": 6,
            "maxItems": 6,
        }
    },
    "required": ["pets"],
    "additionalProperties": False,
}


async def test_a_json_schema_response_with_drafts_is_the_same_valid_json(
    servers: tuple[Server, Server],
) -> None:
    body = {
        "messages": [{"role": "user", "content": "pets?"}],
        "max_tokens": 200,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    }
    texts = []
    drafted = "vllm:spec_decode_num_draft_tokens_total"
    async with httpx.AsyncClient() as client:
        metrics = f"{servers[1].base_url}/metrics"
        before = spec(samples((await client.get(metrics, timeout=30)).text), drafted)
        for server in servers:
            url = f"{server.base_url}/v1/chat/completions"
            response = await client.post(url, json=body, timeout=120)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["message"]["content"])
        after = spec(samples((await client.get(metrics, timeout=30)).text), drafted)
    assert texts[0] == texts[1]
    assert len(json.loads(texts[1])["pets"]) == 6
    assert after > before  # drafts were verified under the grammar's masks
