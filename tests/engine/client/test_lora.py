"""LoRA adapters end to end, peft's merged model (float32) the oracle: each adapter's greedy
tokens equal peft's, alone and mixed in one batch with others and the base; slots and host
memory evicted and refilled; prefix-cache isolation; load, unload and reload at run time
under traffic with no request failing; a bad adapter refused with its reason."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from trillm.common.wire import LoraModule
from trillm.engine import AsyncLLM, EngineConfig, LLMConfig, open_llm
from trillm.engine.client import EngineStartError, LoraNotFoundError
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny
from ...gpu.lora_adapters import edit_config, make_adapter, merged_greedy

pytestmark = pytest.mark.timeout(300)

PROMPTS = [list(range(100, 121)), list(range(300, 317)), list(range(700, 740))]
N = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("lora-engine"), "llama")


@pytest.fixture(scope="module")
def adapters(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny, root / "a", seed=1, r=8),
        "b": make_adapter(tiny, root / "b", seed=2, r=16, rslora=True),
        "c": make_adapter(tiny, root / "c", seed=3, r=4, targets=("q_proj", "v_proj")),
        "d": make_adapter(tiny, root / "d", seed=4, r=8, targets=("o_proj", "down_proj")),
    }


@pytest.fixture(scope="module")
def expected(tiny: Path, adapters: dict[str, Path]) -> dict[tuple[str | None, int], list[int]]:
    """peft's tokens per (adapter, prompt index)."""
    out = {}
    for name in [None, *adapters]:
        for i, prompt in enumerate(PROMPTS):
            out[name, i] = merged_greedy(tiny, None if name is None else adapters[name], prompt, N)
    return out


def config(
    model: Path, modules: Sequence[LoraModule] = (), in_process: bool = True, **worker: object
) -> LLMConfig:
    settings: dict[str, object] = dict(max_loras=2, enable_lora=True, kv_cache_bytes=1 << 25)
    settings.update(worker)
    w = WorkerConfig(str(model), device="cpu", dtype="float32", block_size=16, **settings)  # type: ignore[arg-type]
    engine = EngineConfig(worker=w, lora_modules=tuple(modules))
    return LLMConfig(engine, start_timeout=120, in_process=in_process)


def modules(adapters: dict[str, Path], *names: str) -> list[LoraModule]:
    return [LoraModule(name, str(adapters[name])) for name in names]


async def tokens(llm: AsyncLLM, name: str | None, i: int) -> list[int]:
    return list((await llm.complete(PROMPTS[i], GREEDY, lora_name=name))[0].token_ids)


async def run_all(
    llm: AsyncLLM, jobs: list[tuple[str | None, int]]
) -> dict[tuple[str | None, int], list[int]]:
    got: dict[tuple[str | None, int], list[int]] = {}

    async def one(name: str | None, i: int) -> None:
        got[name, i] = await tokens(llm, name, i)

    async with trio.open_nursery() as nursery:
        for name, i in jobs:
            nursery.start_soon(one, name, i)
    return got


async def test_three_adapters_and_the_base_in_one_batch_each_equal_peft(
    tiny: Path, adapters: dict[str, Path], expected: dict[tuple[str | None, int], list[int]]
) -> None:
    cfg = config(tiny, modules(adapters, "a", "b", "c"), max_loras=3)
    async with open_llm(cfg) as llm:
        with trio.fail_after(240):
            jobs = [(name, i) for name in (None, "a", "b", "c") for i in range(len(PROMPTS))]
            got = await run_all(llm, jobs)
    assert got == {job: expected[job] for job in jobs}


async def test_more_adapters_than_slots_take_turns_and_stay_exact(
    tiny: Path, adapters: dict[str, Path], expected: dict[tuple[str | None, int], list[int]]
) -> None:
    """One slot, one adapter in host memory: each adapter is read again and copied into the
    slot when its turn comes; the scheduler never runs two adapters at once."""
    cfg = config(tiny, modules(adapters, "a", "b", "d"), max_loras=1, max_cpu_loras=1)
    async with open_llm(cfg) as llm:
        with trio.fail_after(240):
            jobs = [(name, i) for i in (0, 2) for name in ("a", "b", None, "d")]
            got = await run_all(llm, jobs)
            again = await tokens(llm, "a", 1)
    assert got == {job: expected[job] for job in jobs}
    assert again == expected["a", 1]


async def hits(llm: AsyncLLM) -> int:
    stats = await llm.utility("stats")
    assert isinstance(stats, dict)
    return int(stats["prefix_cache_hits"])


async def test_the_prefix_cache_keeps_each_adapters_kv_to_itself(
    tiny: Path, adapters: dict[str, Path], expected: dict[tuple[str | None, int], list[int]]
) -> None:
    cfg = config(tiny, modules(adapters, "a", "b"))
    async with open_llm(cfg) as llm:
        with trio.fail_after(120):
            counts, outputs = [], []
            for name in ("a", "a", "b", None, "b", None):
                outputs.append(await tokens(llm, name, 2))  # 40 tokens: 32 can hit
                counts.append(await hits(llm))
    assert counts == [0, 32, 32, 32, 64, 96]
    assert outputs == [expected[name, 2] for name in ("a", "a", "b", None, "b", None)]


async def test_load_unload_and_reload_under_traffic_fail_no_request(
    tiny: Path, adapters: dict[str, Path], expected: dict[tuple[str | None, int], list[int]]
) -> None:
    cfg = config(tiny, modules(adapters, "a"), in_process=False)
    results: list[bool] = []
    async with open_llm(cfg) as llm:
        done = trio.Event()

        async def traffic(name: str | None) -> None:
            i = 0
            while not done.is_set():
                results.append(await tokens(llm, name, i % 3) == expected[name, i % 3])
                i += 1

        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(traffic, None)
                nursery.start_soon(traffic, "a")
                for _ in range(2):  # load, use, unload; then the same name again
                    module = await llm.load_lora_adapter("c", str(adapters["c"]))
                    assert module.lora_int_id >= 2
                    assert await tokens(llm, "c", 0) == expected["c", 0]
                    async with llm.generate(PROMPTS[1], GREEDY, lora_name="c") as stream:
                        first = await stream.__anext__()  # on the engine: then unloaded
                        await llm.unload_lora_adapter("c")
                        async for output in stream:
                            first.merge(output)
                    assert list(first.token_ids) == expected["c", 1]
                    with pytest.raises(LoraNotFoundError, match="'c' is not loaded"):
                        await tokens(llm, "c", 0)
                done.set()
    assert results and all(results)


async def test_an_unload_keeps_the_adapter_for_requests_not_yet_running(
    tiny: Path, adapters: dict[str, Path], expected: dict[tuple[str | None, int], list[int]]
) -> None:
    """A request the engine took but has not run (waiting: the engine is paused) when its
    adapter is unloaded still runs with it: the workers forget the adapter only once no
    unfinished request holds it (before, they dropped it at once, and the request's first
    step failed on an unknown adapter id)."""
    async with open_llm(config(tiny, modules(adapters, "a"))) as llm:
        with trio.fail_after(120):
            await llm.utility("pause")
            async with llm.generate(PROMPTS[0], GREEDY, lora_name="a") as stream:
                await llm.unload_lora_adapter("a")  # after the request, on the same ring
                await llm.utility("resume")
                first = await stream.__anext__()
                async for output in stream:
                    first.merge(output)
            assert list(first.token_ids) == expected["a", 0]
            with pytest.raises(LoraNotFoundError, match="'a' is not loaded"):
                await tokens(llm, "a", 0)
            await llm.load_lora_adapter("a", str(adapters["a"]))  # a new id, same weights
            assert await tokens(llm, "a", 1) == expected["a", 1]


async def test_a_bad_adapter_at_run_time_is_refused_and_the_engine_serves_on(
    tiny: Path,
    adapters: dict[str, Path],
    tmp_path: Path,
    expected: dict[tuple[str | None, int], list[int]],
) -> None:
    bad = make_adapter(tiny, tmp_path / "bad", seed=5, r=32)
    async with open_llm(config(tiny)) as llm:
        with trio.fail_after(120):
            with pytest.raises(ValueError, match="'big': rank 32 is over --max-lora-rank 16"):
                await llm.load_lora_adapter("big", str(bad))
            edit_config(bad, r=8, target_modules=["embed_tokens"])
            with pytest.raises(ValueError, match=r"unsupported target modules \['embed_tokens'\]"):
                await llm.load_lora_adapter("emb", str(bad))
            with pytest.raises(ValueError, match="'none': no adapter this server can read"):
                await llm.load_lora_adapter("none", str(tmp_path / "missing"))
            assert "big" not in llm.loras and not len(llm.loras)
            assert await tokens(llm, None, 0) == expected[None, 0]
            await llm.load_lora_adapter("a", str(adapters["a"]))
            assert await tokens(llm, "a", 0) == expected["a", 0]


async def test_a_bad_adapter_at_start_up_fails_the_start_naming_it(
    tiny: Path, tmp_path: Path
) -> None:
    bad = make_adapter(tiny, tmp_path / "bad", seed=6)
    edit_config(bad, target_modules=["q_proj", "lm_head"])
    cfg = config(tiny, [LoraModule("broken", str(bad))], in_process=False)
    with pytest.raises(EngineStartError, match=r"LoRA adapter 'broken': unsupported target"):
        async with open_llm(cfg):
            pass


@pytest.mark.slow
async def test_tensor_parallel_2_equals_1(
    tiny: Path, adapters: dict[str, Path], expected: dict[tuple[str | None, int], list[int]]
) -> None:
    """A sharded as vLLM (column layers split B, row layers split A), every rank loading the
    adapters: TP 2 gives TP 1's (peft's) tokens, adapters mixed in one batch."""
    base = config(tiny, modules(adapters, "a", "d"), in_process=False)
    tp2 = LLMConfig(
        EngineConfig(worker=base.engine.worker, lora_modules=base.engine.lora_modules,
                     tensor_parallel_size=2),
        start_timeout=240,
    )  # fmt: skip
    async with open_llm(tp2) as llm:
        with trio.fail_after(240):
            jobs = [(name, i) for name in (None, "a", "d") for i in range(2)]
            got = await run_all(llm, jobs)
            await llm.load_lora_adapter("b", str(adapters["b"]))  # at run time, on both ranks
            got["b", 0] = await tokens(llm, "b", 0)
    assert got == {job: expected[job] for job in [*jobs, ("b", 0)]}


@pytest.mark.slow  # the tiny model's tests above take the same path against peft, faster
async def test_the_default_model_with_an_adapter_equals_peft(tmp_path: Path) -> None:
    from trillm.default_model import default_model_dir

    model = Path(default_model_dir(progress=False))
    path = make_adapter(model, tmp_path / "smol", seed=7, r=16, scale=0.3)
    want = merged_greedy(model, path, PROMPTS[0], N)
    base = merged_greedy(model, None, PROMPTS[0], N)
    cfg = config(model, [LoraModule("smol", str(path))], max_model_len=256, kv_cache_bytes=1 << 26)
    async with open_llm(cfg) as llm:
        with trio.fail_after(120):
            got = await run_all(llm, [("smol", 0), (None, 0)])
    assert want != base  # the adapter changes the tokens
    assert (got["smol", 0], got[None, 0]) == (want, base)
