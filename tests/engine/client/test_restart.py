"""Engine restarts: a dead engine is started again, within bounds, and its requests resume.

Real engine processes of the tiny model, killed with SIGKILL. Requests open at the death
resume on the new engine (prompt + the tokens streamed so far) and end with exactly the
tokens of an uninterrupted run; requests sent while the engine restarts wait for it; a
request open at two deaths fails (it may be what kills the engine); past
`max_engine_restarts` within the window the death is final.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio

from trillm.engine import EngineConfig, EngineDeadError, LLMConfig, open_llm
from trillm.engine.client._restarts import RestartPolicy
from trillm.engine.client._sampling_params import SamplingParams
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny
from ...procs import is_dead

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_the_policy_counts_restarts_in_a_sliding_window() -> None:
    policy = RestartPolicy(2, window=10.0)
    assert policy.allow(0.0) and policy.allow(1.0)
    assert not policy.allow(5.0)  # a third within 10 s
    assert policy.allow(10.5)  # the first has left the window
    assert policy.total == 3
    assert not RestartPolicy(0, 1.0).allow(0.0)
    with pytest.raises(ValueError, match="max_engine_restarts"):
        RestartPolicy(-1, 1.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("restart-tiny"), "llama")


def config(model: Path, restarts: int, **engine: object) -> LLMConfig:
    worker = WorkerConfig(
        str(model), device="cpu", dtype="float32", block_size=16, kv_cache_bytes=1 << 25
    )
    return LLMConfig(
        EngineConfig(worker=worker, **engine),  # type: ignore[arg-type]
        start_timeout=120,
        max_engine_restarts=restarts,
    )


async def wait_restarted(llm: object, pid: int) -> None:
    with trio.fail_after(120):
        while not llm.live_engines() or llm.engines[0].process.pid == pid:  # type: ignore[attr-defined]
            await trio.sleep(0.05)


async def test_open_streams_resume_with_the_uninterrupted_tokens(tiny_dir: Path) -> None:
    prompts = [list(range(70 + 30 * i, 90 + 30 * i)) for i in range(3)]
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    async with open_llm(config(tiny_dir, restarts=2)) as llm:
        expected = [(await llm.complete(p, long))[0] for p in prompts]
        short = (await llm.complete(list(range(40, 60)), GREEDY))[0].token_ids
        got: dict[int, tuple[list[int], str]] = {}
        flowing = trio.Event()

        async def held(i: int) -> None:
            tokens: list[int] = []
            text = ""
            async with llm.generate(prompts[i], long) as stream:
                async for out in stream:
                    tokens += out.token_ids
                    text += out.text
                    if len(tokens) > 20:
                        flowing.set()
            got[i] = (tokens, text)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(held, i)
            await flowing.wait()
            pid = llm.engines[0].process.pid
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(30):
                while not llm.restarting:  # the death is known: the restart has begun
                    await trio.sleep(0.005)
            assert not llm.live_engines()
            # Sent while the engine restarts: it waits, then succeeds.
            waiting = (await llm.complete(list(range(40, 60)), GREEDY))[0].token_ids
        assert waiting == short
        for i in range(3):  # the streams paused, then went on as if nothing happened
            assert got[i] == (expected[i].token_ids, expected[i].text)
        assert is_dead(pid) and llm.engines[0].process.pid != pid
        assert llm.restarts.total == 1 and not llm.errored and not llm.restarting


async def test_a_request_open_at_two_deaths_fails_and_the_rest_go_on(tiny_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    # The null executor's 50 ms steps hold the request open through both deaths on any machine.
    slow = config(tiny_dir, restarts=3, executor="null", null_step_time=0.05)
    async with open_llm(slow) as llm:
        failed: list[BaseException] = []
        flowing = trio.Event()

        async def held() -> None:
            try:
                async with llm.generate(list(range(70, 90)), long) as stream:
                    async for _ in stream:
                        flowing.set()
            except EngineDeadError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(held)
            await flowing.wait()
            for _ in range(2):
                pid = llm.engines[0].process.pid
                os.kill(pid, signal.SIGKILL)
                await wait_restarted(llm, pid)
        assert len(failed) == 1
        assert "open at the engine's previous death too" in str(failed[0])
        assert (await llm.complete(list(range(40, 60)), GREEDY))[0].token_ids
        assert llm.restarts.total == 2


async def test_past_the_bound_the_death_is_final(tiny_dir: Path) -> None:
    async with open_llm(config(tiny_dir, restarts=1)) as llm:
        pid = llm.engines[0].process.pid
        os.kill(pid, signal.SIGKILL)
        await wait_restarted(llm, pid)
        os.kill(llm.engines[0].process.pid, signal.SIGKILL)  # the second death in the window
        with trio.fail_after(30):
            error = await llm.wait_dead()
        assert "killed by signal 9" in str(error) and llm.restarts.total == 1
        with pytest.raises(EngineDeadError):
            await llm.complete([1, 2, 3], GREEDY)
