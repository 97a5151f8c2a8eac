"""Engine restarts: a dead engine is started again, within bounds, and its requests resume.

Real engine processes of the tiny model, killed with SIGKILL. Requests open at the death
resume on the new engine (prompt + the tokens streamed so far) and end with exactly the
tokens of an uninterrupted run; requests sent while the engine restarts wait for it; a
request open at two deaths fails (it may be what kills the engine); past
`max_engine_restarts` within the window the death is final.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from pathlib import Path

import pytest
import trio

from trillm.engine import EngineConfig, EngineDeadError, EngineStartError, LLMConfig, open_llm
from trillm.engine.client.engines._restarts import RestartPolicy
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.engine.client.inputs._structured import StructuredOutputs
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny
from ...procs import children, is_dead

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


def config(
    model: Path, restarts: int, inject_fault: str | None = None, **engine: object
) -> LLMConfig:
    worker = WorkerConfig(
        str(model),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_bytes=1 << 25,
        inject_fault=inject_fault,
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
        assert "at 2 deaths in a row and was resumed once" in str(failed[0])
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


POISON = 49000  # the hook raises in every step whose input holds this token


@pytest.mark.slow
async def test_a_poison_request_fails_alone_and_its_batch_mates_complete(tiny_dir: Path) -> None:
    """A request whose token crashes the forward (the `token:` fault hook) is in the batch at
    every death, and so are its batch-mates: they are quarantined, resumed alone (the newest
    first), the poison kills the engine once more alone and fails; the rest complete."""
    prompts = [list(range(100 + 40 * i, 120 + 40 * i)) for i in range(4)]
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    faulty = config(tiny_dir, restarts=3, inject_fault=f"token:0:{POISON}")
    async with open_llm(faulty) as llm:
        expected = [(await llm.complete(p, long))[0].token_ids for p in prompts]
        assert not any(POISON in tokens for tokens in expected)  # the hook spares them
        got: dict[int, list[int]] = {}
        failed: list[BaseException] = []
        flowing = [trio.Event() for _ in prompts]

        async def innocent(i: int) -> None:
            tokens: list[int] = []
            async with llm.generate(prompts[i], long) as stream:
                async for out in stream:
                    tokens += out.token_ids
                    if len(tokens) >= 3:
                        flowing[i].set()
            got[i] = tokens

        async def poison() -> None:
            try:
                await llm.complete([5, 6, POISON, 7], long)
            except EngineDeadError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(innocent, i)
            for event in flowing:  # the poison joins a batch of running requests
                await event.wait()
            nursery.start_soon(poison)
        assert len(failed) == 1
        message = str(failed[0])
        assert "InjectedFault in worker rank 0" in message and "resumed twice" in message, message
        assert got == dict(enumerate(expected))
        assert llm.restarts.total == 3 and not llm.errored
        assert llm.num_request_states == 0


async def test_resume_keeps_n_logprobs_prefix_caching_and_grammars(tiny_dir: Path) -> None:
    """Children of n=2 (sharing a cached prompt), their logprobs, and a grammar whose matcher
    replays the tokens already generated: all equal an uninterrupted run after a SIGKILL."""
    prompt = list(range(200, 240))
    pair = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True, n=2, logprobs=2)
    regex = "(ab|cd|ef){40}x"  # the tiny model's free choice is noise: the mask rules
    constrained = SamplingParams(
        temperature=0.0, max_tokens=90, structured_outputs=StructuredOutputs(regex=regex)
    )
    async with open_llm(config(tiny_dir, restarts=2)) as llm:
        expected_pair = await llm.complete(prompt, pair)
        expected_grammar = (await llm.complete(list(range(300, 320)), constrained))[0]
        got: dict[str, list[object]] = {}
        flowing = [trio.Event(), trio.Event()]

        async def collect(name: str, ids: list[int], params: SamplingParams, i: int) -> None:
            merged: dict[int, object] = {}
            async with llm.generate(ids, params) as stream:
                async for out in stream:
                    if out.index in merged:
                        merged[out.index].merge(out)  # type: ignore[attr-defined]
                    else:
                        merged[out.index] = out
                    if len(out.token_ids) and out.num_output_tokens >= 10:
                        flowing[i].set()
            got[name] = [merged[k] for k in sorted(merged)]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, "pair", prompt, pair, 0)
            nursery.start_soon(collect, "grammar", list(range(300, 320)), constrained, 1)
            for event in flowing:
                await event.wait()
            pid = llm.engines[0].process.pid
            os.kill(pid, signal.SIGKILL)
        assert llm.restarts.total == 1 and not llm.errored
        for want, have in zip(expected_pair, got["pair"], strict=True):
            assert have.token_ids == want.token_ids and have.text == want.text  # type: ignore[attr-defined]
            assert have.logprobs is not None and want.logprobs is not None  # type: ignore[attr-defined]
            assert [t.token_id for t in have.logprobs] == [t.token_id for t in want.logprobs]  # type: ignore[attr-defined]
            for a, b in zip(have.logprobs, want.logprobs, strict=True):  # type: ignore[attr-defined]
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
        (grammar,) = got["grammar"]
        assert grammar.text == expected_grammar.text  # type: ignore[attr-defined]
        assert re.fullmatch(regex, expected_grammar.text), expected_grammar.text


async def test_a_start_up_stopped_before_ready_is_killed_and_named(tiny_dir: Path) -> None:
    """The watchdog covers the start-up too: a stopped engine (before its rings attach, or
    after: loading the model) is killed after the watchdog timeout and named the cause,
    instead of being waited for up to the start timeout (600 s)."""
    before = set(children(os.getpid()))
    stopped: list[int] = []

    async def stop_the_engine() -> None:
        while not (new := set(children(os.getpid())) - before):
            await trio.sleep(0.002)
        stopped.append(new.pop())
        os.kill(stopped[0], signal.SIGSTOP)

    watched = dataclasses.replace(config(tiny_dir, restarts=0), watchdog_timeout=1.0)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_the_engine)
            with pytest.raises(EngineStartError) as caught:
                async with open_llm(watched):
                    pass
    message = str(caught.value)
    assert f"no heartbeat from the engine process (pid {stopped[0]}, state T (stopped))" in message
    assert "more than the watchdog timeout of 1 s" in message
    with trio.fail_after(10):
        while not is_dead(stopped[0]):
            await trio.sleep(0.01)
