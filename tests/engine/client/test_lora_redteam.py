"""Issue 46's LoRA findings against a real engine process: no load, no reload and no control
call ends the engine, whatever it is handed (its pid is the same after each), and a
restarted engine reads the bytes checked before, or skips an adapter that no longer loads.

peft's merged model is the oracle of every adapter's tokens (`lora_adapters`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from safetensors.torch import load_file, save_file

from trillm.common.wire import LoraModule
from trillm.engine import AsyncLLM, EngineConfig, LLMConfig, open_llm
from trillm.engine.client import LoraNotFoundError
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.engine.protocol import _messages as P
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny
from ...gpu.lora_adapters import make_adapter, merged_greedy

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(100, 121))
N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("lora-redteam"), "llama")


@pytest.fixture(scope="module")
def made(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters made once; each test copies the ones it changes."""
    root = tmp_path_factory.mktemp("made")
    return {name: make_adapter(tiny, root / name, seed=i + 1) for i, name in enumerate("abc")}


@pytest.fixture(scope="module")
def expected(tiny: Path, made: dict[str, Path]) -> dict[str | None, list[int]]:
    out = {name: merged_greedy(tiny, path, PROMPT, N) for name, path in made.items()}
    return out | {None: merged_greedy(tiny, None, PROMPT, N)}


def config(model: Path, modules: Sequence[LoraModule] = (), restarts: int = 0) -> LLMConfig:
    worker = WorkerConfig(
        str(model),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_bytes=1 << 25,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,  # a second adapter evicts the first from host memory
    )
    engine = EngineConfig(worker=worker, lora_modules=tuple(modules))
    return LLMConfig(engine, start_timeout=120, in_process=False, max_engine_restarts=restarts)


def copy(made: dict[str, Path], name: str, root: Path) -> Path:
    return Path(shutil.copytree(made[name], root / name))


def pid(llm: AsyncLLM) -> int:
    return llm.engines[0].process.pid


async def tokens(llm: AsyncLLM, name: str | None) -> list[int]:
    return list((await llm.complete(PROMPT, GREEDY, lora_name=name))[0].token_ids)


async def wait_restarted(llm: AsyncLLM, old: int) -> None:
    with trio.fail_after(120):
        while not llm.live_engines() or pid(llm) == old:
            await trio.sleep(0.05)


def checked_copies(llm: AsyncLLM) -> list[Path]:
    return list(Path(llm.config.engine.worker.lora_cache_dir).iterdir())


HOSTILE: list[Any] = [
    None,
    True,
    -1,
    2**63 - 1,
    1.5e308,
    float("nan"),
    "",
    "x" * 100_000,
    "/" + "x/" * 2500,
    "/proc/self/mem",
    "a\0b",
    b"\xff" * 64,
    [],
    [[[]]],
    {"k": "v"},
    {"": [None] * 50},
]


async def test_every_control_call_with_hostile_arguments_leaves_the_engine(
    tiny: Path, expected: dict[str | None, list[int]]
) -> None:
    """Every method of `UTILITY_METHODS`, with arguments of every type (and the right
    number of them, and too many): answered, never the engine's death."""
    async with open_llm(config(tiny)) as llm:
        engine = pid(llm)
        with trio.fail_after(240):
            for method in sorted(P.UTILITY_METHODS):
                for value in HOSTILE:
                    for args in ([value], [value] * 4, [value, "/missing", None, 7]):
                        with contextlib.suppress(ValueError):
                            await llm.utility(method, 0, args)
                    if method in ("sleep", "pause"):  # whatever took: undone
                        await llm.utility("wake_up", 0, [])
                        await llm.utility("resume", 0, [])
                assert pid(llm) == engine and not llm.restarting, method
            with pytest.raises(ValueError, match="no profile is running"):  # none started
                await llm.utility("stop_profile", 0, [])
            assert await tokens(llm, None) == expected[None]
        assert pid(llm) == engine and llm.restarts.total == 0


async def test_paths_the_filesystem_refuses_are_refused_and_the_engine_serves_on(
    tiny: Path, made: dict[str, Path], tmp_path: Path, expected: dict[str | None, list[int]]
) -> None:
    """Findings 1, 2 and 5: a path too long, a file that is a link to /proc/self/mem or
    /dev/zero, a FIFO, a file over its cap; each one a refusal naming why, at once."""
    long_path = "/".join(["d" * 200] * 25)  # 5,024 characters
    proc = copy(made, "a", tmp_path / "proc")
    (proc / "adapter_model.safetensors").unlink()
    (proc / "adapter_model.safetensors").symlink_to("/proc/self/mem")
    zero = copy(made, "a", tmp_path / "zero")
    (zero / "adapter_model.safetensors").unlink()
    (zero / "adapter_model.safetensors").symlink_to("/dev/zero")
    fifo = copy(made, "a", tmp_path / "fifo")
    (fifo / "adapter_model.safetensors").unlink()
    os.mkfifo(fifo / "adapter_model.safetensors")
    config_fifo = copy(made, "a", tmp_path / "config-fifo")
    (config_fifo / "adapter_config.json").unlink()
    os.mkfifo(config_fifo / "adapter_config.json")
    huge = copy(made, "a", tmp_path / "huge")
    with open(huge / "adapter_config.json", "ab") as f:
        f.truncate((1 << 20) + 1)
    cases = [
        (long_path, "its path has 5024 characters, over 4096"),
        (str(proc), "no adapter this server can read"),
        (str(zero), "no adapter this server can read"),
        (str(fifo), "no adapter this server can read"),
        (str(config_fifo), "no adapter this server can read"),
        (str(huge), "adapter_config.json has 1048577 bytes, over the 1048576"),
        ("rel\0ative", "no adapter this server can read"),
    ]
    async with open_llm(config(tiny)) as llm:
        engine = pid(llm)
        for i, (path, message) in enumerate(cases):
            with trio.fail_after(30):  # the FIFO froze the loop: here it is refused at once
                with pytest.raises(ValueError, match=message):
                    await llm.load_lora_adapter(f"bad{i}", path)
            assert pid(llm) == engine
        assert not len(llm.loras)
        assert await tokens(llm, None) == expected[None]
        assert pid(llm) == engine and llm.restarts.total == 0


async def test_a_bad_path_does_not_say_whether_the_directory_exists(
    tiny: Path, tmp_path: Path
) -> None:
    """Finding 8: a missing directory, a file, and a directory that is no adapter get the
    same words (but for the path they echo)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    async with open_llm(config(tiny)) as llm:
        messages = []
        for path in (tmp_path / "missing", tmp_path / "file", tmp_path / "empty", Path("/etc")):
            with pytest.raises(ValueError) as caught:
                await llm.load_lora_adapter("probe", str(path))
            messages.append(str(caught.value).replace(repr(str(path)), "PATH"))
        assert len(set(messages)) == 1, messages


async def test_an_adapter_of_nan_weights_is_refused(
    tiny: Path, made: dict[str, Path], tmp_path: Path
) -> None:
    """Finding 8: all-NaN weights loaded and answered empty text."""
    nan = copy(made, "a", tmp_path)
    weights = load_file(nan / "adapter_model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()},
              nan / "adapter_model.safetensors")  # fmt: skip
    async with open_llm(config(tiny)) as llm:
        with pytest.raises(ValueError, match="its weights hold NaN or infinite values"):
            await llm.load_lora_adapter("nan", str(nan))
        assert not len(llm.loras)


async def evict_a(llm: AsyncLLM, a: Path, b: Path, expected: dict[str | None, list[int]]) -> None:
    """Load a and b, serve a then b: a leaves its slot and host memory (one of each)."""
    await llm.load_lora_adapter("a", str(a))
    await llm.load_lora_adapter("b", str(b))
    assert await tokens(llm, "a") == expected["a"]
    assert await tokens(llm, "b") == expected["b"]


async def test_an_evicted_adapter_comes_back_from_its_checked_copy_never_its_path(
    tiny: Path, made: dict[str, Path], tmp_path: Path, expected: dict[str | None, list[int]]
) -> None:
    """Finding 3: an adapter evicted from host memory is read again inside a step. Its
    folder moved, or other weights put there after the checks: the engine reads the checked
    copy, and answers with the weights it checked."""
    a, b = copy(made, "a", tmp_path), copy(made, "b", tmp_path)
    async with open_llm(config(tiny)) as llm:
        engine = pid(llm)
        await evict_a(llm, a, b, expected)
        shutil.copytree(made["c"], tmp_path / "c")
        a.rename(tmp_path / "a-moved")
        (tmp_path / "c").rename(a)  # other weights under a's path
        assert await tokens(llm, "a") == expected["a"]
        assert await tokens(llm, "b") == expected["b"]
        assert await tokens(llm, "a") == expected["a"]
        assert pid(llm) == engine


async def test_a_read_again_that_fails_fails_its_requests_alone(
    tiny: Path, made: dict[str, Path], tmp_path: Path, expected: dict[str | None, list[int]]
) -> None:
    """The checked copy gone too (and the folder moved): the requests of that adapter fail
    with the reason; those of the base and other adapters in the same steps go on."""
    a, b = copy(made, "a", tmp_path), copy(made, "b", tmp_path)
    async with open_llm(config(tiny)) as llm:
        engine = pid(llm)
        await evict_a(llm, a, b, expected)
        a.rename(tmp_path / "a-moved")
        for checked in checked_copies(llm):
            shutil.rmtree(checked)
        got: dict[str | None, object] = {}

        async def one(name: str | None) -> None:
            try:
                got[name] = await tokens(llm, name)
            except Exception as exc:
                got[name] = exc

        async with trio.open_nursery() as nursery:
            for name in ("a", None, "b"):
                nursery.start_soon(one, name)
        assert got[None] == expected[None] and got["b"] == expected["b"]
        assert isinstance(got["a"], Exception)
        assert "LoRA adapter 'a': no adapter this server can read" in str(got["a"])
        assert pid(llm) == engine and llm.restarts.total == 0


async def test_a_restarted_engine_reads_the_checked_bytes_and_skips_what_no_longer_loads(
    tiny: Path, made: dict[str, Path], tmp_path: Path, expected: dict[str | None, list[int]]
) -> None:
    """Findings 3 and deliver 3: after a restart, an adapter whose folder moved is served
    from its checked copy; one whose copy is gone too is skipped (on stderr), dropped from
    the adapters, and the restart succeeds: the server is never down for one adapter."""
    a, b = copy(made, "a", tmp_path), copy(made, "b", tmp_path)
    async with open_llm(config(tiny, [LoraModule("a", str(a))], restarts=3)) as llm:
        await llm.load_lora_adapter("b", str(b))
        assert await tokens(llm, "a") == expected["a"]
        digest_b = llm.loras.by_name["b"].digest
        a.rename(tmp_path / "a-moved")
        old = pid(llm)
        os.kill(old, signal.SIGKILL)
        await wait_restarted(llm, old)
        assert await tokens(llm, "a") == expected["a"]
        assert await tokens(llm, "b") == expected["b"]
        shutil.rmtree(Path(llm.config.engine.worker.lora_cache_dir) / digest_b)
        b.rename(tmp_path / "b-moved")
        old = pid(llm)
        os.kill(old, signal.SIGKILL)
        await wait_restarted(llm, old)
        assert "b" not in llm.loras and "a" in llm.loras
        with pytest.raises(LoraNotFoundError):
            await tokens(llm, "b")
        assert await tokens(llm, "a") == expected["a"]
        assert await tokens(llm, None) == expected[None]
