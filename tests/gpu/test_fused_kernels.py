"""The fused Triton kernels of the CUDA decode step (`_fused_kernels`), under the interpreter
on the CPU, against the torch modules they replace: bf16 bit for bit (each kernel rounds
where the torch ops do), fp32 within rounding; and whole models of every family, the fused
forward's bf16 hidden states equal to the torch forward's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gpu import families
from tests.gpu.conftest import make_runner, save_tiny
from trillm.gpu.layers import _fused_kernels as fused
from trillm.gpu.layers._layers import RMSNorm
from trillm.gpu.layers._rotary import RotaryEmbedding
from trillm.gpu.runner._kernels import fused_kernels_for

DTYPES = [torch.bfloat16, torch.float32]


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16: the same bits; fp32: within a few ulps (torch's fp32 RMSNorm is one fused
    kernel and its addcmul an FMA, whose orders the kernels do not copy)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama's w * x.to(dtype); Gemma's (1 + w)
def test_rms_norm_is_the_modules_norm(dtype: torch.dtype, offset: float) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(96, 1e-6, dtype, offset=offset)
    norm.weight.data.normal_(0, 1)
    x = (torch.randn(37, 96) * 4).to(dtype)
    _check(fused.rms_norm(x, norm.weight, norm.eps, offset), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    norm = RMSNorm(64, 1e-5, dtype)
    norm.weight.data.normal_(1, 0.5)
    x, residual = (torch.randn(2, 19, 64) * 3).to(dtype)
    normed, summed = fused.add_rms_norm(x, residual, norm.weight, norm.eps, 0.0)
    assert torch.equal(summed, x + residual)  # the bf16 add, rounded once
    _check(normed, norm(x + residual))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_reads_heads_out_of_the_qkv_rows(dtype: torch.dtype) -> None:
    """Qwen3's q/k norms: [T, H, D] views of the qkv projection (row stride past H D)."""
    torch.manual_seed(3)
    norm = RMSNorm(16, 1e-6, dtype)
    norm.weight.data.normal_(1, 0.5)
    qkv = torch.randn(7, 8 * 16).to(dtype)
    q = qkv[:, : 4 * 16].view(-1, 4, 16)
    assert not q.is_contiguous()
    _check(fused.rms_norm(q, norm.weight, norm.eps, 0.0), norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_times_up(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    gate_up = (torch.randn(9, 2 * 80) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _check(fused.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [16, 12])  # whole heads; Phi-3's partial rotary
def test_rope_write_kv_rotates_q_and_k_and_stores_k_and_v(
    dtype: torch.dtype, rotary_dim: int
) -> None:
    torch.manual_seed(5)
    heads, kv_heads, d, block = 4, 2, 16, 8
    rotary = RotaryEmbedding(rotary_dim, 64, 10000.0, None, dtype)
    positions = torch.tensor([3, 9, 0, 17, 40, 41])
    slots = torch.tensor([1, 9, -1, 20, 31, 2])  # -1: a padding row writes nothing
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * d).to(dtype)
    rope = rotary.angles(positions)
    k_cache = torch.full((4, block, kv_heads, d), 7.0, dtype=dtype)
    v_cache = k_cache.clone()
    q = fused.rope_write_kv(qkv, rope, k_cache, v_cache, slots, heads, kv_heads)

    qk = rotary.rotate(qkv[:, : (heads + kv_heads) * d].view(-1, heads + kv_heads, d), rope)
    k_ref = torch.full_like(k_cache, 7.0).view(-1, kv_heads, d)
    v_ref = k_ref.clone()
    kept = slots >= 0
    k_ref[slots[kept]] = qk[kept, heads:]
    v_ref[slots[kept]] = qkv[kept, (heads + kv_heads) * d :].view(-1, kv_heads, d)
    _check(q, qk[:, :heads].contiguous())
    _check(k_cache.view(-1, kv_heads, d), k_ref)
    assert torch.equal(v_cache.view(-1, kv_heads, d), v_ref)  # copied, never rounded


def test_the_fused_kernels_are_chosen_on_cuda_with_triton_only() -> None:
    assert fused_kernels_for(torch.device("cuda", 0), "triton")
    assert not fused_kernels_for(torch.device("cuda", 0), "torch")
    assert not fused_kernels_for(torch.device("cpu"), "triton")  # the CPU keeps its ops
    assert not fused_kernels_for(torch.device("cpu"), "torch")


def _hidden(model_dir: Path, on: bool) -> torch.Tensor:
    """The final hidden states of one mixed step (a 5-token prompt, a 3-token chunk after 4
    cached tokens, a decode after 6) in bf16 with the triton backend, fused kernels `on`."""
    runner = make_runner(
        model_dir, dtype="bfloat16", attention_backend="triton", enforce_eager=True,
        num_blocks=8, cpu_linear="aten",
    )  # fmt: skip
    assert runner.model is not None and runner.attention is not None
    assert runner.model.fused is None  # the CPU's choice
    runner.model.use_fused(on)
    counts = np.array([5, 3, 1])
    contexts = np.array([5, 7, 7])
    tables = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    positions = np.concatenate([np.arange(c - n, c) for n, c in zip(counts, contexts, strict=True)])
    seq = np.repeat(np.arange(3), counts)
    slots = tables[seq, positions // 8] * 8 + positions % 8
    slots[-1] = -1  # a padding row, as in a graph
    meta = runner.attention.metadata(counts, contexts, tables, slots, torch.from_numpy)
    ids = torch.from_numpy(50 + positions * 3 + seq)
    with torch.inference_mode():
        return runner.model(ids, torch.from_numpy(positions), runner.kv_caches, meta)


@pytest.mark.parametrize("family", ["llama", "qwen2", *families.DENSE, "mixtral"])
def test_a_fused_forward_is_the_torch_forward_bit_for_bit(family: str, tmp_path: Path) -> None:
    """Every family's forward in bf16: the residual adds fused into the norms (Llama's block)
    or not (Gemma's sandwich, OLMo 2's post-norms, Granite's multiplier), q/k norms, partial
    rotary, layers without rotary, experts: the same bits as the torch ops."""
    if family in ("llama", "qwen2"):
        model_dir = save_tiny(tmp_path, family)
    else:
        model_dir = families.save(family, tmp_path)
    plain, fused_out = _hidden(model_dir, False), _hidden(model_dir, True)
    assert plain.dtype == torch.bfloat16
    assert torch.equal(fused_out, plain), (fused_out.float() - plain.float()).abs().max()
