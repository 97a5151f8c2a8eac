"""The CPU linear kernel choice: the probe, both branches of the choice, and the truth of both.

The choice is a function of the probe's answer (`CpuFeatures`), so every branch runs on every
machine: an AVX-512 machine still takes the AVX2 fallback here, and an AVX2 machine still
packs float32 (which oneDNN runs on any x86-64 CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trillm.gpu import CpuFeatures, CpuLinearUnsupportedError, probe_cpu_features
from trillm.gpu._cpu_linear import (
    choose_cpu_linear,
    pack_weight,
    packed_linear,
    packed_linear_available,
    packed_silu_mul,
    packed_silu_mul_available,
)
from trillm.gpu._cpu_ops import silu_mul
from trillm.gpu._model_config import ModelConfig
from trillm.gpu._parallel import TensorParallel
from trillm.gpu.models.llama import LlamaMLP

# An AVX2-only CPU as torch sees it: oneDNN packs float32 only (the machine of issue 12).
AVX2 = CpuFeatures("AVX2", onednn_packs=frozenset({"float32"}))
AVX512_BF16 = CpuFeatures(
    "AVX512", avx512=True, avx512_bf16=True, onednn_packs=frozenset({"float32", "bfloat16"})
)
NO_ONEDNN = CpuFeatures("AVX2")


@pytest.mark.parametrize(
    ("features", "dtype", "path"),
    [
        (AVX2, torch.float32, "onednn"),
        (AVX2, torch.bfloat16, "aten"),
        (AVX2, torch.float16, "aten"),
        (AVX512_BF16, torch.bfloat16, "onednn"),
        (AVX512_BF16, torch.float16, "aten"),
        (NO_ONEDNN, torch.float32, "aten"),
    ],
)
def test_auto_packs_exactly_the_dtypes_the_cpu_runs(
    features: CpuFeatures, dtype: torch.dtype, path: str
) -> None:
    assert choose_cpu_linear("auto", dtype, features).path == path


def test_the_fallback_says_why() -> None:
    choice = choose_cpu_linear("auto", torch.bfloat16, AVX2)
    assert choice.reason == (
        "oneDNN cannot pack bfloat16 on this CPU "
        "(it needs avx512bw, avx512vl and avx512dq, or avx_ne_convert)"
    )
    assert choose_cpu_linear("auto", torch.float32, NO_ONEDNN).reason == (
        "this torch build has no oneDNN linear ops"
    )


def test_aten_is_taken_when_asked_whatever_the_cpu() -> None:
    assert choose_cpu_linear("aten", torch.bfloat16, AVX512_BF16).path == "aten"


def test_onednn_asked_for_a_dtype_the_cpu_cannot_run_is_an_error_naming_the_cpu() -> None:
    with pytest.raises(
        CpuLinearUnsupportedError,
        match=r"cpu_linear='onednn' cannot run: oneDNN cannot pack bfloat16 on this CPU .*"
        r"\(CPU: AVX2 -avx512 -avx512_bf16 -amx onednn:float32\); use cpu_linear='auto' or "
        r"'aten' \(plain F.linear\), or dtype float32",
    ):
        choose_cpu_linear("onednn", torch.bfloat16, AVX2)
    assert choose_cpu_linear("onednn", torch.float32, AVX2).path == "onednn"


def test_the_summary_names_the_features_the_choice_read() -> None:
    assert AVX512_BF16.summary() == "AVX512 avx512 avx512_bf16 -amx onednn:float32,bfloat16"
    assert NO_ONEDNN.summary() == "AVX2 -avx512 -avx512_bf16 -amx onednn:none"


def test_the_probe_is_made_once_and_matches_torch() -> None:
    features = probe_cpu_features()
    assert probe_cpu_features() is features
    assert features.isa == torch.backends.cpu.get_cpu_capability()
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        assert "float32" in features.onednn_packs  # any x86-64 CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_probe_tells_the_truth_about_packing(dtype: torch.dtype) -> None:
    """Where the probe says yes, a real weight packs and multiplies right; where it says no,
    packing raises (the crash the probe exists to avoid)."""
    weight = torch.randn(64, 32).to(dtype)
    x = torch.randn(3, 32).to(dtype)
    if str(dtype).removeprefix("torch.") in probe_cpu_features().onednn_packs:
        out = packed_linear(x, pack_weight(weight), None)
        tolerance = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(
            out, torch.nn.functional.linear(x, weight), atol=tolerance, rtol=0.02
        )
    elif torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        with pytest.raises(RuntimeError):
            pack_weight(weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_post_op_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    """SiLU(x . gate) * (x . up) as oneDNN's post-ops, against torch's float64, where this CPU
    packs the dtype (float32 always); bfloat16 to its rounding. There the probe must say yes:
    it runs the same products, so a wrong one would otherwise only turn the path off."""
    if not packed_linear_available(dtype) or not hasattr(
        torch.ops.mkldnn._linear_pointwise, "binary"
    ):
        pytest.skip(f"oneDNN does not pack {dtype} here, or this torch has no post-op products")
    assert packed_silu_mul_available(dtype)
    gen = torch.Generator().manual_seed(0)
    x, gate, up = (torch.randn(n, 96, generator=gen) for n in (37, 160, 160))
    x, gate, up = x.to(dtype), (gate * 0.2).to(dtype), (up * 0.2).to(dtype)
    got = packed_silu_mul(x, pack_weight(gate), pack_weight(up))
    want = F.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_a_packed_silu_mlp_runs_the_post_ops_and_still_gives_gate_up() -> None:
    """A bfloat16 SiLU MLP packed on a CPU that runs the post-ops keeps gate and up apart:
    its forward is the post-op product (the C SiLU's result to bfloat16 rounding), and the
    gate/up linear itself still answers [gate | up] (what LoRA adds its deltas to)."""
    if not packed_silu_mul_available(torch.bfloat16):
        pytest.skip("oneDNN's post-op products do not run bfloat16 here")
    config = ModelConfig.from_dict(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 32}
    )  # fmt: skip
    mlp = LlamaMLP(config, TensorParallel(), torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(192, 64, generator=gen) * 0.2).bfloat16()
    mlp.gate_up_proj.weight.data.copy_(weight)
    mlp.down_proj.weight.data.copy_((torch.randn(64, 96, generator=gen) * 0.2).bfloat16())
    down = mlp.down_proj.weight.detach().clone()
    x = torch.randn(21, 64, generator=gen).bfloat16()
    want = F.linear(silu_mul(F.linear(x, weight)), down)
    mlp.gate_up_proj.pack()
    mlp.down_proj.pack()
    assert mlp.gate_up_proj.packed_gate_up is not None and mlp.gate_up_proj.packed is None
    torch.testing.assert_close(mlp.gate_up_proj(x), F.linear(x, weight), atol=0.05, rtol=0.02)
    torch.testing.assert_close(mlp(x), want, atol=0.05, rtol=0.05)
