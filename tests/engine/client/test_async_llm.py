"""The trio frontend against a real engine running the tiny model: in its own process, and
in process (`LLMConfig.in_process`, a thread of this one), the same tests for both. The few
about a process (its signals, its exit, its parent) run split only."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from trillm.engine import (
    AsyncLLM,
    EngineConfig,
    EngineDeadError,
    EngineStartError,
    LLMConfig,
    PromptTooLongError,
    open_llm,
)
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("frontend-tiny"), "llama")


@pytest.fixture(params=["split", "in_process"])
def in_process(request: pytest.FixtureRequest) -> bool:
    return bool(request.param == "in_process")


def llm_config(model: Path | str, in_process: bool = False, **worker: object) -> LLMConfig:
    config = WorkerConfig(
        str(model),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_bytes=1 << 25,
        **worker,  # type: ignore[arg-type]
    )
    return LLMConfig(EngineConfig(worker=config), start_timeout=120, in_process=in_process)


@pytest.fixture
async def llm(tiny_dir: Path, in_process: bool) -> AsyncIterator[AsyncLLM]:
    async with open_llm(llm_config(tiny_dir, in_process)) as llm:
        yield llm


# A split engine is a process start per test (about 10 s on the loaded 2-core machine); the
# in-process engine runs the same client, rings and engine core. Tests about what a request
# gets (not about a process) run split in `make test-slow` only; the split runs that stay in
# `make test` (streaming, cancellation, the limit refusal, deaths, start failures) keep the
# process path covered.
SPLIT_SLOW = [pytest.param("split", marks=pytest.mark.slow), "in_process"]


def split_only(in_process: bool, why: str) -> None:
    if in_process:
        pytest.skip(f"about the engine process: {why}")


async def test_streaming_equals_non_streaming(llm: AsyncLLM) -> None:
    whole = (await llm.complete("The quick brown fox", GREEDY))[0]
    chunks = []
    async with llm.generate("The quick brown fox", GREEDY) as stream:
        async for output in stream:
            chunks.append(output)
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert len(whole.token_ids) == 12 and chunks[-1].finish_reason == "length"
    assert whole.text == llm.tokenizer.decode(whole.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("in_process", SPLIT_SLOW, indirect=True)
async def test_n_4_gives_four_tagged_completions(llm: AsyncLLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    outputs = await llm.complete("Once upon a time", params)
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 6 for o in outputs)
    assert len({tuple(o.token_ids) for o in outputs}) > 1  # different seeds per child
    again = await llm.complete("Once upon a time", params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]


@pytest.mark.parametrize("in_process", SPLIT_SLOW, indirect=True)
async def test_logprobs_come_with_every_token(llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    output = (await llm.complete("Hello", params))[0]
    assert output.logprobs is not None and len(output.logprobs) == 5
    for token, lp in zip(output.token_ids, output.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the best is the sampled


@pytest.mark.parametrize("in_process", SPLIT_SLOW, indirect=True)
async def test_stop_string_across_token_boundaries_is_excluded(llm: AsyncLLM) -> None:
    full = (await llm.complete("In the beginning", GREEDY)).pop()
    text = full.text
    assert len(text) > 6
    stop = text[3:9]  # six characters that very likely span a token boundary
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    got = (await llm.complete("In the beginning", params))[0]
    assert got.text == text[: text.index(stop)]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    kept = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert (await llm.complete("In the beginning", kept))[0].text == text[: text.index(stop)] + stop


@pytest.mark.parametrize("in_process", SPLIT_SLOW, indirect=True)
async def test_a_stop_token_is_the_stop_reason_and_eos_is_none(llm: AsyncLLM) -> None:
    """vLLM's stop_reason: the id from stop_token_ids that ended the output; None for EOS."""
    full = (await llm.complete("In the beginning", GREEDY)).pop()
    token = full.token_ids[3]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[token])
    got = (await llm.complete("In the beginning", params))[0]
    assert got.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert (got.finish_reason, got.stop_reason) == ("stop", token)
    eos = llm.tokenizer.eos_token_id
    assert eos is not None
    forced = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100.0})
    ended = (await llm.complete("In the beginning", forced))[0]
    assert ended.token_ids == [eos]
    assert (ended.finish_reason, ended.stop_reason) == ("stop", None)


@pytest.mark.parametrize("in_process", SPLIT_SLOW, indirect=True)
async def test_a_slow_consumer_receives_every_token(llm: AsyncLLM) -> None:
    """A consumer that reads nothing while the engine finishes gets the rest in one merged
    output: causality, not timing (the other request cannot finish before this one)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    whole = (await llm.complete("Slowly", params))[0]
    tokens: list[int] = []
    chunks = 0
    async with llm.generate("Slowly", params) as stream:
        async for output in stream:
            tokens += output.token_ids
            chunks += 1
            if chunks == 1:
                # Admitted later with as many tokens to make, it finishes in this request's
                # last step or after it: every remaining output is now merged in the mailbox.
                await llm.complete("Meanwhile", params)
    assert tokens == whole.token_ids
    assert chunks <= 2  # 30 tokens, one per step: merged (1 if the first read came late)


async def test_cancelled_consumers_abort_in_the_engine(llm: AsyncLLM) -> None:
    baseline = await llm.utility("stats")
    rng = random.Random(3)

    async def consume_then_leave(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        with trio.move_on_after(rng.uniform(0.0, 0.5)):
            async with llm.generate([100 + i % 50] * (1 + i % 20), params) as stream:
                async for _ in stream:
                    if rng.random() < 0.1:
                        break

    async with trio.open_nursery() as nursery:
        for i in range(1000):
            nursery.start_soon(consume_then_leave, i)
    with trio.fail_after(30):
        while True:
            stats = await llm.utility("stats")
            assert isinstance(stats, dict) and isinstance(baseline, dict)
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            await trio.sleep(0.05)
    assert stats["num_free_blocks"] == baseline["num_free_blocks"]
    assert not len(llm._processor)


async def test_sigkill_of_the_engine_fails_64_streams_naming_sigkill(
    llm: AsyncLLM, in_process: bool
) -> None:
    split_only(in_process, "a thread cannot be killed alone")
    errors: list[BaseException] = []
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    started = trio.Event()
    counter = [0]

    async def stream_until_death(i: int) -> None:
        try:
            async with llm.generate([10 + i], params) as stream:
                async for _ in stream:
                    counter[0] += 1
                    if counter[0] >= 64:
                        started.set()
        except EngineDeadError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for i in range(64):
            nursery.start_soon(stream_until_death, i)
        await started.wait()
        killed = time.monotonic()
        os.kill(llm.ready.pid, signal.SIGKILL)
    elapsed = time.monotonic() - killed
    assert len(errors) == 64 and elapsed < 2.0  # at once: the pidfd, not a timeout (30 s)
    assert all("killed by signal 9 (SIGKILL)" in str(e) for e in errors)
    assert llm.errored
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        async with llm.generate("after", GREEDY):
            pass


async def test_an_injected_forward_exception_names_the_exception_and_function(
    tiny_dir: Path, in_process: bool
) -> None:
    async with open_llm(llm_config(tiny_dir, in_process, inject_fault="forward:0:3")) as llm:
        with pytest.raises(EngineDeadError, match="InjectedFault in worker rank 0") as info:
            await llm.complete("boom", SamplingParams(max_tokens=50, ignore_eos=True))
        assert "LlamaForCausalLM.forward" in str(info.value)
        assert "in forward" in str(info.value.__cause__)


async def test_a_bad_model_path_fails_fast_with_the_engines_message(
    tmp_path: Path, in_process: bool
) -> None:
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="does not exist"):
        async with open_llm(llm_config(tmp_path / "missing", in_process)):
            pass
    assert time.monotonic() - started < 30


async def test_prompt_plus_max_tokens_over_the_limit_is_refused_quoting_both(llm: AsyncLLM) -> None:
    with pytest.raises(PromptTooLongError, match="has 10 tokens and max_tokens is 600"):
        async with llm.generate([5] * 10, SamplingParams(max_tokens=600)):
            pass


@pytest.mark.parametrize("in_process", SPLIT_SLOW, indirect=True)
async def test_prompt_logprobs_cover_every_prompt_token(llm: AsyncLLM) -> None:
    prompt = [20 + i for i in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    output = (await llm.complete(prompt, params))[0]
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    entries = [e for e in output.prompt_logprobs[1:] if e is not None]
    assert [e.token_id for e in entries] == prompt[1:]
    assert all(e.logprob <= 0 and len(e.top) == 2 for e in entries)


async def test_an_engine_that_dies_before_attaching_names_its_exit(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, in_process: bool
) -> None:
    split_only(in_process, "its interpreter exits before it attaches")
    monkeypatch.setattr("sys.executable", "/bin/false")  # the "engine" exits 1 at once
    with pytest.raises(
        EngineStartError, match="the engine failed to start: engine exited with code 1"
    ):
        async with open_llm(llm_config(tiny_dir)):
            pass


@pytest.mark.slow
async def test_the_engine_outlives_trios_idle_worker_threads(
    llm: AsyncLLM, in_process: bool
) -> None:
    """Regression: spawned from a trio worker thread, the engine got its parent-death
    SIGKILL when trio reaped that thread after 10 s idle."""
    split_only(in_process, "its parent-death signal")
    await trio.to_thread.run_sync(lambda: None)  # a worker thread exists, then idles
    await trio.sleep(12)
    output = (await llm.complete("still there?", GREEDY))[0]
    assert len(output.token_ids) == 12 and not llm.errored
