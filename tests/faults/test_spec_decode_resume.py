"""SIGKILL of an engine that speculates (n-gram drafts), and its streams resume on the next.

A resumed request is readmitted with its outputs so far as context (`client._resume`); the
drafts it had pending die with the engine and its successor proposes afresh, so the greedy
text must equal an uninterrupted run's. On the default model: the tiny one ends its streams
before a client has read their first tokens, so a kill would find nothing open.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from trillm.default_model import default_model_dir

from .http_harness import parse_metrics
from .proc_harness import completion_texts, served, stream_through_strike

pytestmark = pytest.mark.timeout(600)

NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 5}'
)
# Prompts the model goes on repeating: lookup's drafts are mostly accepted.
PROMPTS = [
    "Repeat after me: " + "the cat sat on the mat, " * 6,
    "Count: one two three, one two three, one two three, one two three,",
    "Copy this list: red, green, blue, red, green, blue, red, green, blue,",
]


@pytest.mark.slow
async def test_streams_of_a_speculating_engine_resume_with_the_uninterrupted_text() -> None:
    body = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
    args = ("--max-engine-restarts", "2", "--max-model-len", "512")
    with served(default_model_dir(), *args, "--speculative-config", NGRAM) as server:
        url = f"{server.base_url}/v1/completions"
        async with httpx.AsyncClient(timeout=300) as client:
            expected = await completion_texts(client, url, PROMPTS, body)  # never interrupted
            engine = server.engine_pid()
            got = await stream_through_strike(
                client, url, PROMPTS, body, lambda: os.kill(engine, signal.SIGKILL)
            )
            metrics = parse_metrics((await client.get(f"{server.base_url}/metrics")).text)
        assert not got.errors
        assert got.texts == expected
        assert got.first_after_strike is not None, (
            f"no token after the kill: every stream had ended before it\n{server.output()}"
        )
        assert "open requests resume on it" in server.output()
        # Both engines verified drafts: the counter adds the new engine's from zero.
        assert metrics["trillm:spec_decode_num_accepted_tokens_total"] > 0
        assert metrics["trillm:engine_restarts_total"] == 1
