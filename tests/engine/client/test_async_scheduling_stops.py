"""Stop strings with `--async-scheduling`: the frontend cuts the text and aborts the request
while the engine may have a step in flight for it; the client sees what the synchronous
engine gives, stop string, reason and all (the tiny model, an engine in process: the same
rings, client and engine core as a process, without three process starts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from trillm.engine import LLMConfig, open_llm
from trillm.engine.client.inputs._sampling_params import SamplingParams

from .test_async_llm import llm_config, tiny_dir

__all__ = ["tiny_dir"]  # the fixture, imported for this module's tests

PROMPTS = ("In the beginning", "Once upon a time", "The quick brown fox")


def seeded(i: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def completions(config: LLMConfig, stops: list[str] | None) -> list[tuple[str, object]]:
    async with open_llm(config) as llm:
        got = []
        for i, prompt in enumerate(PROMPTS):
            params = seeded(i) if stops is None else seeded(i, stop=[stops[i]])
            output = (await llm.complete(prompt, params))[0]
            got.append((output.text, output.stop_reason))
        return got


@pytest.mark.timeout(240)
async def test_stop_strings_cut_the_same_text_with_async_scheduling(tiny_dir: Path) -> None:
    sync = llm_config(tiny_dir, in_process=True)  # the same engine core, no process starts
    ahead = dataclasses.replace(
        sync, engine=msgspec.structs.replace(sync.engine, async_scheduling=True)
    )
    full = await completions(sync, None)
    stops = [text[len(text) // 2 : len(text) // 2 + 4] for text, _ in full]  # mid-text
    expected = await completions(sync, stops)
    assert [text for text, _ in expected] == [
        t[: t.index(s)] for (t, _), s in zip(full, stops, strict=True)
    ]
    assert [reason for _, reason in expected] == stops
    assert await completions(ahead, stops) == expected
