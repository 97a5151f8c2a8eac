"""Data parallelism in the frontend: two engine processes, routing, one engine's death.

The engines run the tiny model (real processes, real rings); the router's rules are also
tested alone, on token ids.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from trillm.engine import AsyncLLM, EngineConfig, EngineDeadError, LLMConfig, open_llm
from trillm.engine.client import DataParallelRankError, PinnedEngineDeadError
from trillm.engine.client.engines._router import EngineRouter
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.engine.client.outputs._streams import RequestStream
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny

pytestmark = pytest.mark.timeout(300)


def test_router_spreads_by_load_and_keeps_prefixes_together() -> None:
    router = EngineRouter(2, block_size=16, slack=2)
    both = [0, 1]
    system = list(range(100, 164))  # a 4-block shared prefix
    first = router.choose([*system, 1, 2, 3], both)
    router.loads[first] += 1
    assert router.choose(list(range(500, 540)), both) != first  # a new prompt: the idle engine
    for i in range(2):  # the same prefix stays while the engine is not much busier
        assert router.choose([*system, 7, i], both) == first
        router.loads[first] += 1
    assert router.choose([*system, 9], both) != first  # three more than the other: it spills
    router.engine_died(1 - first)
    assert router.choose(list(range(900, 950)), [first]) == first
    assert router.choose([*system, 9], [first]) == first  # its prefix's engine is the only one
    with pytest.raises(LookupError):
        router.choose([1, 2, 3], [])


def test_short_prompts_have_no_prefix_to_follow() -> None:
    router = EngineRouter(2, block_size=16)
    router.loads[0] = 1
    assert router.choose(list(range(16)), [0, 1]) == 1  # one block is all there is: no prefix


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("dp-tiny"), "llama")


@pytest.fixture
async def llm(tiny_dir: Path) -> AsyncIterator[AsyncLLM]:
    worker = WorkerConfig(
        str(tiny_dir), device="cpu", dtype="float32", block_size=16, kv_cache_bytes=1 << 25
    )
    config = LLMConfig(EngineConfig(worker=worker), start_timeout=120, data_parallel_size=2)
    async with open_llm(config) as llm:
        yield llm


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine_of(llm: AsyncLLM, stream: RequestStream) -> int:
    """The engine a stream's request was routed to."""
    states = [s for e in range(len(llm.engines)) for s in llm._processor.of_engine(e)]
    return next(state.engine for state in states if state.mailbox is stream._mailbox)


async def test_two_engines_serve_and_give_the_same_greedy_tokens(llm: AsyncLLM) -> None:
    assert len(llm.engines) == 2 and llm.live_engines() == [0, 1]
    results: dict[int, list[int]] = {}
    used: set[int] = set()

    async def one(i: int) -> None:
        async with llm.generate(list(range(300 + i, 340 + i)), GREEDY) as stream:
            used.add(engine_of(llm, stream))
            results[i] = [t async for out in stream for t in out.token_ids]

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(one, i)
    assert used == {0, 1}  # at once, the load spread them over both engines
    for i in range(6):  # each engine's tokens are the model's: equal to a request alone
        alone = (await llm.complete(list(range(300 + i, 340 + i)), GREEDY))[0].token_ids
        assert results[i] == alone


async def test_one_engines_death_fails_only_its_streams(llm: AsyncLLM) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    outcomes: dict[int, object] = {}
    on_engine: dict[int, int] = {}
    started = trio.Event()

    async def stream(i: int) -> None:
        try:
            async with llm.generate(list(range(600 + 50 * i, 620 + 50 * i)), long) as s:
                on_engine[i] = engine_of(llm, s)
                if len(on_engine) == 4:
                    started.set()
                outcomes[i] = len([t async for out in s for t in out.token_ids])
        except EngineDeadError as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(stream, i)
        await started.wait()
        assert set(on_engine.values()) == {0, 1}
        os.kill(llm.engines[1].process.pid, signal.SIGKILL)
    for i, engine in on_engine.items():
        if engine == 1:
            error = outcomes[i]
            assert isinstance(error, EngineDeadError)
            assert "engine 1 process killed by signal 9" in str(error)
        else:
            assert outcomes[i] == 400
    assert llm.live_engines() == [0] and not llm.errored
    again = await llm.complete(list(range(700, 730)), GREEDY)  # new requests still succeed
    assert len(again[0].token_ids) == 8
    with pytest.raises(EngineDeadError, match="engine 1"):
        await llm.utility("ping", engine=1)


async def test_a_pinned_request_runs_on_its_rank_and_is_refused_once_it_died(
    llm: AsyncLLM,
) -> None:
    prompt = list(range(800, 840))  # one prompt: the router alone would keep it on one engine
    for rank in (1, 0, 1, 1, 0):
        async with llm.generate(prompt, GREEDY, data_parallel_rank=rank) as stream:
            assert engine_of(llm, stream) == rank
            assert len([t async for out in stream for t in out.token_ids]) == 8
    with pytest.raises(DataParallelRankError, match=r"^data_parallel_rank must be in \[0, 2\)"):
        await llm.prepare(prompt, GREEDY, data_parallel_rank=2)
    pid = llm.engines[1].process.pid
    os.kill(pid, signal.SIGKILL)  # no restarts here: dead for good
    with trio.fail_after(60):
        while llm.live_engines() != [0]:
            await trio.sleep(0.02)
    with pytest.raises(PinnedEngineDeadError) as caught:
        await llm.complete(prompt, GREEDY, data_parallel_rank=1)
    assert str(caught.value).startswith(
        "data_parallel_rank 1's engine is dead (the engine died: engine 1 process killed by "
        "signal 9"
    )
    assert caught.value.rank == 1
    again = await llm.complete(prompt, GREEDY, data_parallel_rank=0)
    assert len(again[0].token_ids) == 8


def test_a_pinned_prompt_leaves_its_prefix_with_its_engine() -> None:
    router = EngineRouter(2, block_size=16)
    system = list(range(40))
    router.remember([*system, 1], 1)
    assert router.choose([*system, 2], [0, 1]) == 1  # the pinned one's prefix is on 1
    assert router.choose([*system, 2], [0, 1], cache_salt="other") == 0  # not another salt's


def test_engines_on_one_cpu_split_its_cores(tiny_dir: Path) -> None:
    """Two engines of torch's default threads each oversubscribe the cores (dp_bench: 0.25x
    one engine on 2 cores): each gets its share instead."""
    worker = WorkerConfig(str(tiny_dir), device="cpu")
    configs = LLMConfig(EngineConfig(worker=worker), data_parallel_size=2).engine_configs()
    assert len(configs) == 2
    assert {c.cpu_threads for c in configs} == {max(1, len(os.sched_getaffinity(0)) // 2)}
    alone = LLMConfig(EngineConfig(worker=worker)).engine_configs()
    assert [c.cpu_threads for c in alone] == [0]  # one engine: torch's default
