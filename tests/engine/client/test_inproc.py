"""The in-process engine (`LLMConfig(in_process=True)`): the engine core on a thread of this
process, behind the same rings and client, with the same results and the same errors."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import trio

from trillm.engine import EngineConfig, EngineDeadError, LLMConfig, open_llm
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.gpu import WorkerConfig

from ...faults.proc_harness import completion, served
from ...gpu.conftest import save_tiny
from ...procs import children

pytestmark = pytest.mark.timeout(180)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("inproc-tiny"), "llama")


def config(model: Path, in_process: bool, **worker: object) -> LLMConfig:
    return LLMConfig(
        EngineConfig(
            worker=WorkerConfig(
                str(model),
                device="cpu",
                dtype="float32",
                kv_cache_bytes=1 << 25,
                **worker,  # type: ignore[arg-type]
            )
        ),
        start_timeout=120,
        in_process=in_process,
    )


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trillm::engine"]


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"trillm-{os.getpid()}-")}


async def test_in_process_gives_the_split_engines_tokens_on_a_thread_of_this_process(
    tiny_dir: Path,
) -> None:
    async with open_llm(config(tiny_dir, in_process=False)) as llm:
        expected = [(await llm.complete(p, GREEDY))[0].token_ids for p in PROMPTS]
    before = set(children(os.getpid()))
    async with open_llm(config(tiny_dir, in_process=True)) as llm:
        assert llm.engines[0].process.pid == os.getpid()
        assert len(engine_threads()) == 1
        assert set(children(os.getpid())) == before  # no engine process
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            got[i] = (await llm.complete(PROMPTS[i], GREEDY))[0].token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
        assert [got[i] for i in range(len(PROMPTS))] == expected
        assert await llm.utility("ping") == "pong"
    with trio.fail_after(10):
        while engine_threads():
            await trio.sleep(0.01)
    assert not shm_names()


async def test_an_in_process_engine_death_is_the_same_error_with_its_root_cause(
    tiny_dir: Path,
) -> None:
    async with open_llm(config(tiny_dir, in_process=True, inject_fault="forward:0:3")) as llm:
        with pytest.raises(EngineDeadError, match="InjectedFault in worker rank 0, raised in "):
            await llm.complete(PROMPTS[0], GREEDY)
        with trio.fail_after(10):
            await llm.wait_dead()
        assert llm.errored
        with pytest.raises(EngineDeadError, match="InjectedFault"):
            await llm.complete(PROMPTS[1], GREEDY)
    assert not engine_threads() and not shm_names()


def test_in_process_is_one_engine() -> None:
    worker = WorkerConfig("unused", device="cpu")
    with pytest.raises(ValueError, match="data_parallel_size must be 1 with in_process, got 2"):
        LLMConfig(EngineConfig(worker=worker), in_process=True, data_parallel_size=2)


async def test_trillm_serve_engine_in_process_serves_from_one_process(tiny_dir: Path) -> None:
    with served(tiny_dir, "--engine-in-process") as server:
        assert children(server.pid) == []  # the engine is a thread of the API server
        reply = await trio.to_thread.run_sync(lambda: completion(server, max_tokens=4))
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        server.process.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(server.wait_exit, 60) == 0
