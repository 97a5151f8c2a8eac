"""The CPU linear kernel choice: the probe, both branches of the choice, and the truth of both.

The choice is a function of the probe's answer (`CpuFeatures`), so every branch runs on every
machine: an AVX-512 machine still takes the AVX2 fallback here, and an AVX2 machine still
packs float32 (which oneDNN runs on any x86-64 CPU).
"""

from __future__ import annotations

import pytest
import torch

from trillm.gpu import CpuFeatures, CpuLinearUnsupportedError, probe_cpu_features
from trillm.gpu.cpu._cpu_linear import (
    BF16_WITHOUT_HARDWARE,
    choose_cpu_linear,
    pack_weight,
    packed_linear,
)

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
        "(it needs avx512bw, avx512vl and avx512dq, or avx_ne_convert)" + BF16_WITHOUT_HARDWARE
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
