"""`trillm serve --attention-backend triton` gives the torch backend's greedy tokens.

On the default model (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads), for a batch
of prompts sent at once: one shorter than a block that decodes across the block boundary,
one whose prefill spans two blocks, one of a single block. On CPU the triton kernels run
through Triton's interpreter, so the server says so at start-up.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from trillm.default_model import default_model_dir

from .conftest import start_server

# Slow: the interpreter takes about 2-5 s per decode step of this 30-layer model here, and
# a machine 2-4x slower with its other core busy would stretch it past `make test`'s pace.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

BLOCK = 16
NEW_TOKENS = 8
# Token ids of SmolLM2's vocabulary, so the prompt lengths (and the blocks) are exact.
PROMPTS = [
    list(range(1000, 1011)),  # 11 tokens + 8 generated: decodes cross into block 2
    list(range(2000, 2023)),  # 23 tokens: the prefill fills block 1 and part of block 2
    list(range(3000, 3005)),
]


def greedy_tokens(model: Path, backend: str, stderr_path: Path) -> tuple[list[list[str]], str]:
    with open(stderr_path, "wb") as stderr:
        server = start_server(
            model,
            *("--attention-backend", backend, "--block-size", str(BLOCK), "--max-model-len", "256"),
            stderr=stderr,
        )
        try:

            def complete(prompt: list[int]) -> list[str]:
                reply = httpx.post(
                    f"{server.base_url}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": prompt,
                        "max_tokens": NEW_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                        "logprobs": 0,
                    },
                    timeout=300,
                )
                assert reply.status_code == 200, reply.text
                return list(reply.json()["choices"][0]["logprobs"]["tokens"])

            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: one batch
                tokens = list(pool.map(complete, PROMPTS))
            kernels = httpx.get(f"{server.base_url}/version").json()["kernels"]
        finally:
            assert server.stop() == 0
    assert kernels["attention"] == backend
    return tokens, stderr_path.read_text()


def test_triton_backend_gives_the_torch_backends_greedy_tokens(tmp_path: Path) -> None:
    model = default_model_dir()
    expected, _ = greedy_tokens(model, "torch", tmp_path / "torch.err")
    got, log = greedy_tokens(model, "triton", tmp_path / "triton.err")
    assert all(len(t) == NEW_TOKENS for t in expected)
    assert got == expected
    assert "attention triton (Triton's interpreter on CPU: for correctness only" in log
