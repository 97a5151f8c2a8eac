"""`_native`: the C kernels are built once, and without a compiler the torch paths run.

Kept apart from test_cpu_decode.py, which skips where nothing builds: these are the cases
that matter exactly there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from trillm.gpu import WorkerConfig
from trillm.gpu.cpu import _native
from trillm.gpu.cpu._cpu_decode import build_cpu_step
from trillm.gpu.models.llama import LlamaForCausalLM

from .conftest import make_runner

pytestmark = pytest.mark.timeout(120)


def test_no_compiler_falls_back_to_torch(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRILLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    _native.load.cache_clear()
    try:
        runner = make_runner(tiny_model_dir, enforce_eager=True)
        assert runner.model is not None
        # built from a fresh model: its dense weights are packed away in `runner`
        config = WorkerConfig(str(tiny_model_dir), device="cpu")
        decode, word = build_cpu_step(_fresh_model(tiny_model_dir), config, 8)
        assert decode is None
        assert word.startswith("torch (no C compiler 'no-such-cc'") and "install gcc" in word
    finally:
        _native.load.cache_clear()


@pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="needs a C compiler to fail"
)
def test_compiler_errors_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "CSRC", tmp_path)
    monkeypatch.setenv("TRILLM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "broken.c").write_text("int f( {\n")
    with pytest.raises(_native.NativeBuildError, match=r"could not build broken.c .*error"):
        _native.load("broken")
    assert not list((tmp_path / "cache").glob("**/*.tmp"))  # no half-written object left


def _fresh_model(model_dir: Path) -> LlamaForCausalLM:
    from trillm.gpu import TensorParallel, open_model

    model_config, weights = open_model(str(model_dir), "auto")
    model = LlamaForCausalLM(model_config, TensorParallel(), torch.float32)
    model.load_weights(weights)
    return model
