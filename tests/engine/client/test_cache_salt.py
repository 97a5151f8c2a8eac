"""`cache_salt` end to end: the engine's prefix-cache hit counters show tenants isolated."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trillm.engine import AsyncLLM, open_llm
from trillm.engine.client.inputs._sampling_params import SamplingParams

from ...gpu.conftest import save_tiny
from .test_async_llm import llm_config

pytestmark = pytest.mark.timeout(180)


async def hits(llm: AsyncLLM) -> int:
    stats = await llm.utility("stats")
    assert isinstance(stats, dict)
    return int(stats["prefix_cache_hits"])


async def test_same_salt_hits_another_salt_misses_no_salt_is_its_own_tenant(
    tmp_path: Path,
) -> None:
    prompt = list(range(100, 141))  # 41 tokens, blocks of 16: 32 can hit

    def params(salt: str | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt=salt)

    # In process: the prefix cache is the engine core's, the same on a thread (no process start).
    async with open_llm(llm_config(save_tiny(tmp_path, "llama"), in_process=True)) as llm:
        with trio.fail_after(120):
            outputs, counts = [], []
            for salt in ("a", "a", "b", None, None, "b"):
                outputs.append((await llm.complete(prompt, params(salt)))[0].token_ids)
                counts.append(await hits(llm))
    assert counts == [0, 32, 32, 32, 64, 96]
    assert all(tokens == outputs[0] for tokens in outputs)  # the salt changes no token
