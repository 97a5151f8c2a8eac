"""Speculative decoding at tensor parallel 2: the same greedy tokens as one rank, and as no
speculation. The drafts ride the step's broadcast record (`StepBatch.draft_token_ids`), so
every rank verifies the same ones; rank 0's sampled tokens decide what is accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trillm.engine import EngineConfig, LLMConfig, SamplingParams, open_llm
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
)
PROMPTS = ["one two one two one two", "a b c a b c a b", "speculate"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("spec-tp-tiny"), "llama")


def config(model: Path, *, tp: int, spec: str | None) -> LLMConfig:
    worker = WorkerConfig(
        str(model),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_bytes=1 << 25,
        max_model_len=256,
        speculative_config=spec,
    )
    return LLMConfig(EngineConfig(worker=worker, tensor_parallel_size=tp), start_timeout=240)


async def greedy_tokens(
    model: Path, *, tp: int, spec: str | None
) -> tuple[list[list[int]], dict[str, Any]]:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    async with open_llm(config(model, tp=tp, spec=spec)) as llm:
        tokens = []
        for prompt in PROMPTS:
            (out,) = await llm.complete(prompt, params)
            tokens.append(out.token_ids)
        stats = await llm.utility("stats")
    assert isinstance(stats, dict)
    return tokens, stats


@pytest.mark.slow
async def test_tensor_parallel_2_speculates_the_tokens_of_one_rank(tiny_dir: Path) -> None:
    plain, _ = await greedy_tokens(tiny_dir, tp=1, spec=None)
    one, _ = await greedy_tokens(tiny_dir, tp=1, spec=NGRAM)
    two, stats = await greedy_tokens(tiny_dir, tp=2, spec=NGRAM)
    assert one == plain
    assert two == one
    assert 0 < stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]
