"""The torch forward's dense linears on the C step's tiles (`_prompt_linears`): the same
tokens as on oneDNN, taken only where measured faster, and kept in the probe's cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trillm.gpu import ModelRunner, TensorParallel, WorkerConfig, open_model
from trillm.gpu.cpu import _decode_probe
from trillm.gpu.cpu import _prompt_linears as prompt_linears
from trillm.gpu.cpu._cpu_linear import packed_linear_available
from trillm.gpu.cpu._decode_paths import MARGIN, PromptTiming
from trillm.gpu.cpu._tiles import TiledLinear, tiled_kernels

from .conftest import make_runner, save_tiny
from .driver import Driver, DriverRequest

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(tiled_kernels() is None, reason="no C compiler here: no C step"),
    pytest.mark.skipif(
        not packed_linear_available(torch.float32), reason="no oneDNN: nothing to compare"
    ),
]
PROMPTS = [list(range(100 + 13 * i, 140 + 13 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("prompt-linears"), "llama")


def _greedy(runner: ModelRunner) -> list[list[int]]:
    requests = [DriverRequest(i, p, 4) for i, p in enumerate(PROMPTS)]
    Driver(runner, 64).run(requests)
    return [r.output for r in requests]


def test_the_tiles_give_the_prompts_the_tokens_onednn_gives(tiny: Path) -> None:
    onednn, tiled = make_runner(tiny), make_runner(tiny)
    assert tiled.cpu_step is not None and tiled.model is not None
    rows = prompt_linears.tiled_linears(tiled.cpu_step, tiled.model)
    assert len(rows) == len(tiled.model.decoder_layers()) and all(len(r) == 4 for r in rows)
    x = torch.randn(40, tiled.model.config.hidden_size)
    for linear, tiles in rows[0][:1]:  # qkv: the same product either way
        assert linear.packed is not None
        torch.testing.assert_close(tiles(x), prompt_linears.packed_linear(x, linear.packed, None))
    prompt_linears.use_tiles(rows)
    assert all(lin.packed is None and isinstance(lin.quantized, TiledLinear) for lin, _ in rows[0])
    assert _greedy(tiled) == _greedy(onednn)


def test_the_tiles_take_the_prompts_only_by_the_margin() -> None:
    assert PromptTiming(512, MARGIN * 10.0, 10.0).tiles_win
    assert not PromptTiming(512, MARGIN * 10.0 + 0.01, 10.0).tiles_win
    assert "on the C tiles (512 tokens" in PromptTiming(512, 5.0, 10.0).describe()
    assert "in torch (512 tokens" in PromptTiming(512, 10.0, 5.0).describe()


def _auto_runner(model_dir: Path) -> ModelRunner:
    config = WorkerConfig(str(model_dir), device="cpu", max_num_seqs=4)
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
    runner.load_model(weights)
    runner.init_kv_cache(64)
    return runner


@pytest.mark.parametrize("tiles_ms", [1.0, 100.0], ids=["tiles-win", "onednn-wins"])
def test_auto_measures_the_prompt_linears_and_caches_the_answer(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiles_ms: float
) -> None:
    monkeypatch.setattr(_decode_probe, "paths_dir", lambda: tmp_path / "decode_paths")
    calls: list[int] = []

    def timed(layer: object, dtype: torch.dtype) -> PromptTiming:
        calls.append(1)
        return PromptTiming(512, tiles_ms, 10.0)

    monkeypatch.setattr(_decode_probe, "measure_prompt_linears", timed)
    for _ in range(2):  # measured, then read from the cache
        runner = _auto_runner(tiny)
        assert runner.model is not None and runner.kernels is not None
        qkv = runner.model.decoder_layers()[0].self_attn.qkv_proj
        where = "on the C tiles" if tiles_ms < 10.0 else "in torch"
        assert f"prompts' linears {where}" in runner.kernels.decode
        assert isinstance(qkv.quantized, TiledLinear) == (tiles_ms < 10.0)
        assert (qkv.packed is None) == (tiles_ms < 10.0)
    assert len(calls) == 1 and "cached" in runner.kernels.decode
