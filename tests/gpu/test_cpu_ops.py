"""The C one-pass norms of the torch forward (`_cpu_ops.CpuNorms`) against torch's ops, and the
forward that uses them against the forward without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trillm.gpu.cpu import _native
from trillm.gpu.cpu._cpu_ops import CpuNorms, cpu_norms
from trillm.gpu.layers import _layers
from trillm.gpu.layers._layers import RMSNorm
from trillm.gpu.models import llama

from .conftest import make_runner, save_tiny


def _norms() -> CpuNorms:
    norms = cpu_norms(torch.zeros(1))
    if norms is None:
        pytest.skip("the C kernels did not build here")
    return norms


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Hugging Face's float32 RMSNorm, op by op."""
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight + offset) * normed


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("hidden", [64, 72, 5], ids=["vectors", "tail", "short"])
@pytest.mark.parametrize("rows", [37, 1100])  # 1100 x 64: past `GRAIN`, on every thread
def test_add_rms_norm_is_the_sum_and_its_norm(offset: float, hidden: int, rows: int) -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(rows, hidden) * 3, torch.randn(rows, hidden)
    weight = torch.randn(hidden)
    out, total = _norms().add_rms_norm(x, residual, weight, 1e-6, offset)
    assert torch.equal(total, x + residual)  # the same float32 adds
    torch.testing.assert_close(out, _reference(x + residual, weight, 1e-6, offset))
    plain = _norms().rms_norm(x, weight, 1e-6, offset)
    torch.testing.assert_close(plain, _reference(x, weight, 1e-6, offset))


def test_rows_keep_their_shape_and_none_is_none() -> None:
    x = torch.randn(3, 4, 32)
    out, total = _norms().add_rms_norm(x, x, torch.ones(32), 1e-5, 0.0)
    assert out.shape == total.shape == (3, 4, 32)
    empty = _norms().rms_norm(torch.empty(0, 32), torch.ones(32), 1e-5, 0.0)
    assert empty.shape == (0, 32)


def test_float32_and_bfloat16_on_the_cpu_take_the_c_norms() -> None:
    assert cpu_norms(torch.zeros(2, dtype=torch.float16)) is None
    if cpu_norms(torch.zeros(2)) is not None:
        assert cpu_norms(torch.zeros(2, dtype=torch.bfloat16)) is not None


def _reference_bf16(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's bfloat16 decoder step, op by op: the residual added in bfloat16, the
    norm in float32, cast back before Llama's weight (Gemma's 1 + w multiplied in float32)."""
    total = x if residual is None else residual + x
    x32 = total.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(torch.bfloat16), total
    return weight * normed.to(torch.bfloat16), total


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart a and b are, elementwise (same signs)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("hidden", [64, 72, 5], ids=["vectors", "tail", "short"])
@pytest.mark.parametrize("rows", [37, 1100])
def test_bfloat16_norms_round_as_torch_does(offset: float, hidden: int, rows: int) -> None:
    """The residual is torch's bfloat16 sum exactly; the normed rows equal torch's op-by-op
    bfloat16 result but where the float32 sum of squares, summed in another order, tips a
    rounding: at most one bfloat16 step, in a small fraction of the elements."""
    torch.manual_seed(2)
    x = (torch.randn(rows, hidden) * 3).bfloat16()
    residual = torch.randn(rows, hidden).bfloat16()
    weight = torch.randn(hidden).bfloat16()
    out, total = _norms().add_rms_norm(x, residual, weight, 1e-6, offset)
    want, want_total = _reference_bf16(x, residual, weight, 1e-6, offset)
    assert out.dtype == total.dtype == torch.bfloat16
    assert torch.equal(total, want_total)
    apart = _ulps_apart(out, want)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 0.01
    plain = _norms().rms_norm(x, weight, 1e-6, offset)
    apart = _ulps_apart(plain, _reference_bf16(x, None, weight, 1e-6, offset)[0])
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 0.01


@pytest.mark.parametrize("width", [2 * 64, 2 * 40], ids=["vectors", "tail"])
def test_bfloat16_silu_mul_rounds_as_torch_does(width: int) -> None:
    """SiLU(gate) rounded to bfloat16, then the product rounded: torch's two ops, up to one
    bfloat16 step where C's exp and torch's differ in the last float32 bits."""
    from trillm.gpu.cpu._cpu_ops import silu_mul

    _norms()
    torch.manual_seed(3)
    gate_up = (torch.randn(300, width) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate_up)
    assert got.dtype == torch.bfloat16
    apart = _ulps_apart(got, want)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 0.01


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_the_module_norms_rows_in_c_and_head_views_in_torch(offset: float) -> None:
    """A contiguous input goes to the C kernel; per-head q/k views of a qkv row (strided)
    stay torch's: both give the reference."""
    _norms()
    torch.manual_seed(1)
    norm = RMSNorm(16, 1e-6, torch.float32, offset=offset)
    norm.weight.data.normal_()
    qkv = torch.randn(5, 3 * 16 + 8)
    heads = qkv[:, :48].view(5, 3, 16)  # not contiguous
    torch.testing.assert_close(norm(heads), _reference(heads, norm.weight, 1e-6, offset))
    rows = heads.contiguous()
    torch.testing.assert_close(norm(rows), _reference(rows, norm.weight, 1e-6, offset))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_forward_with_c_norms_is_the_torch_forward(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixed float32 step (prompt, chunk, decode) with the residual adds fused into the C
    norms, against the same step with torch's adds and norms."""
    _norms()
    model_dir = save_tiny(tmp_path, family)
    calls = []
    add_rms_norm = CpuNorms.add_rms_norm

    def counted(self: CpuNorms, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args[0].shape)
        return add_rms_norm(self, *args)

    monkeypatch.setattr(CpuNorms, "add_rms_norm", counted)
    fused = _step(model_dir)
    assert calls == [(9, 64)] * 4  # both post-attention norms, layer 1's input, the final
    monkeypatch.setattr(llama, "cpu_norms", lambda x: None)
    monkeypatch.setattr(_layers, "cpu_norms", lambda x: None)
    plain = _step(model_dir)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def _step(model_dir: Path) -> torch.Tensor:
    """The final hidden states of one float32 step: a 5-token prompt, a 3-token chunk after 4
    cached tokens, a decode after 6 (the torch forward, C attention)."""
    runner = make_runner(model_dir, num_blocks=8, cpu_linear="aten")
    assert runner.model is not None and runner.attention is not None
    counts, contexts = np.array([5, 3, 1]), np.array([5, 7, 7])
    tables = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    positions = np.concatenate([np.arange(c - n, c) for n, c in zip(counts, contexts, strict=True)])
    seq = np.repeat(np.arange(3), counts)
    slots = tables[seq, positions // 8] * 8 + positions % 8
    meta = runner.attention.metadata(counts, contexts, tables, slots, torch.from_numpy)
    ids = torch.from_numpy(50 + positions * 3 + seq)
    with torch.inference_mode():
        return runner.model(ids, torch.from_numpy(positions), runner.kv_caches, meta)


LEVEL_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from tests.gpu import test_cpu_ops as t
for offset in (0.0, 1.0):
    for hidden in (64, 72, 5):
        for rows in (37, 1100):
            t.test_add_rms_norm_is_the_sum_and_its_norm(offset, hidden, rows)
            t.test_bfloat16_norms_round_as_torch_does(offset, hidden, rows)
for width in (2 * 64, 2 * 40):
    t.test_bfloat16_silu_mul_rounds_as_torch_does(width)
print("ok")
"""


@pytest.mark.parametrize(
    "march", ["icelake-server", "x86-64-v3", "x86-64"], ids=["avx512-without-bf16", "avx2", "sse2"]
)
@pytest.mark.slow
def test_the_builds_without_avx512_bf16_norm_the_same(march: str, tmp_path: Path) -> None:
    """Without AVX512_BF16 the bfloat16 kernels round in integer lanes (`tl_norm.h`
    `to_bf16x16`), not with `vcvtneps2bf16`: the same results."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 levels")
    if march == "icelake-server" and "avx512f" not in _native._cpu_flags().split():
        pytest.skip("this CPU cannot run AVX-512 code")
    env = {**os.environ, "TRILLM_CPU_MARCH": march, "TRILLM_CACHE_DIR": str(tmp_path)}
    root = str(Path(__file__).resolve().parents[2])
    command = [sys.executable, "-c", LEVEL_CHILD, root]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert list(tmp_path.glob("kernels/cpu_decode-*.so"))  # built for that level, apart
