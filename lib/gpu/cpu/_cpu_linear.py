"""Linear layers on the CPU through oneDNN, with each weight packed once at load, where the
CPU can run the dtype; plain `F.linear` where it cannot.

Why oneDNN: PyTorch's CPU `F.linear` calls MKL's sgemm, and MKL runs only its AVX2 kernels on
AMD processors, whatever they support. oneDNN (which PyTorch also ships) picks its kernels from
the CPU's own feature flags, so on an AVX-512 machine it does twice the FLOPs per cycle. Packing
the weight once into oneDNN's blocked layout also removes the per-call packing sgemm does, which
made sgemm stall on weights streamed from memory. On the 2-core AMD EPYC of our CI machines
(AVX-512, where MKL stays on AVX2), 30 layers of SmolLM2-135M's float32 linears took, per
forward: 146 -> 62 ms at 128 tokens, 52 -> 22 ms at 32, 24.8 -> 11.6 ms at 1
(`perf/linear_bench.py`, which measures it on any machine).

Why a probe: oneDNN packs float32 on any x86-64 CPU, but bfloat16 only with AVX-512
(BW, VL, DQ) or AVX-NE-CONVERT, and float16 only with AVX512-FP16 or AVX-NE-CONVERT; on an
AVX2-only CPU `_reorder_linear_weight` raises for bfloat16, which stopped the server at load.
`probe_cpu_features` asks torch once per process what this CPU (as oneDNN and ATen see it:
`ONEDNN_MAX_CPU_ISA` and `ATEN_CPU_CAPABILITY` lower it) can do, and confirms each dtype by
packing a tiny weight; `choose_cpu_linear` decides from that answer alone, so tests force
either branch by passing a `CpuFeatures` of their own.

The packed weight is an opaque `torch._mkldnn` tensor: it is used only through
`packed_linear`, and the dense copy is dropped once packed (loading is over by then).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# What oneDNN needs to pack each reduced-precision dtype (torch's own check, in its words).
_NEEDS = {
    torch.bfloat16: "avx512bw, avx512vl and avx512dq, or avx_ne_convert",
    torch.float16: "avx512_fp16 or avx_ne_convert",
}


# What a bfloat16 model on a CPU without oneDNN's bfloat16 (AVX2: no AVX-512 BW/VL/DQ, no
# AVX-NE-CONVERT) costs: F.linear multiplies it without hardware support, one [512, 576] x
# [576, 1536] product 60.4 ms against float32's 7.8 (15 against 117 GFLOP/s, 2 Zen 2 cores;
# perf/README.md "Issue 45"), so its prompts run about 8x slower than float32's. `--dtype auto`
# is float32 on the CPU; an explicit bfloat16 is served, and the start-up line says this.
BF16_WITHOUT_HARDWARE = (
    "; its products run in F.linear without bfloat16 hardware (8x float32's time on an AVX2 "
    "Zen 2, perf/README.md): --dtype float32 (auto's choice on the CPU) serves faster"
)


class CpuLinearUnsupportedError(RuntimeError):
    """`cpu_linear="onednn"` was asked for a dtype this CPU's oneDNN cannot pack."""


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU and this torch build can do for linears, as probed once per process.

    `isa` is ATen's dispatch level ("AVX512", "AVX2", "DEFAULT"); `avx512`, `avx512_bf16` and
    `amx` are the hardware's flags; `onednn_packs` the dtypes oneDNN packed in the probe.
    """

    isa: str
    avx512: bool = False
    avx512_bf16: bool = False
    amx: bool = False
    onednn_packs: frozenset[str] = frozenset()

    def summary(self) -> str:
        """What the choice depended on: `AVX512 avx512 avx512_bf16 -amx onednn:float32,bfloat16`."""
        flags = [f"{'' if on else '-'}{name}" for name, on in self._flags()]
        packs = ",".join(sorted(self.onednn_packs, key=list(_NAMES.values()).index)) or "none"
        return " ".join([self.isa, *flags, f"onednn:{packs}"])

    def _flags(self) -> list[tuple[str, bool]]:
        return [("avx512", self.avx512), ("avx512_bf16", self.avx512_bf16), ("amx", self.amx)]


@dataclass(frozen=True)
class LinearChoice:
    """Which linear kernel runs, and why, in words a log line can carry."""

    path: str  # "onednn" or "aten"
    reason: str


@functools.cache
def probe_cpu_features() -> CpuFeatures:
    """Ask torch what this CPU can do (once per process; about 10 ms, most of it the packs)."""
    cpu = torch.cpu
    packs = frozenset(_NAMES[dtype] for dtype in _NAMES if _onednn_ops_present() and _packs(dtype))
    return CpuFeatures(
        isa=torch.backends.cpu.get_cpu_capability(),
        avx512=_flag(getattr(cpu, "_is_avx512_supported", None)),
        avx512_bf16=_flag(getattr(cpu, "_is_avx512_bf16_supported", None)),
        amx=_flag(getattr(cpu, "_is_amx_tile_supported", None)),
        onednn_packs=packs,
    )


def choose_cpu_linear(requested: str, dtype: torch.dtype, features: CpuFeatures) -> LinearChoice:
    """The linear kernel for `dtype` on a CPU with `features`.

    Args:
        requested: "auto" (oneDNN where it packs the dtype, else F.linear), "onednn" (oneDNN
            or an error), or "aten" (F.linear).

    Raises:
        CpuLinearUnsupportedError: "onednn" was asked for and oneDNN cannot pack `dtype` here.
    """
    name = _NAMES.get(dtype, str(dtype))
    if requested == "aten":
        return LinearChoice("aten", "cpu_linear=aten asked for")
    if name in features.onednn_packs:
        return LinearChoice("onednn", f"oneDNN packs {name} on this CPU")
    if not features.onednn_packs:
        why = "this torch build has no oneDNN linear ops"
    elif dtype in _NEEDS:
        why = f"oneDNN cannot pack {name} on this CPU (it needs {_NEEDS[dtype]})"
    else:
        why = f"oneDNN does not pack {name}"
    if requested == "onednn":
        raise CpuLinearUnsupportedError(
            f"cpu_linear='onednn' cannot run: {why} (CPU: {features.summary()}); use "
            f"cpu_linear='auto' or 'aten' (plain F.linear), or dtype float32"
        )
    if dtype == torch.bfloat16 and features.onednn_packs:
        why += BF16_WITHOUT_HARDWARE
    return LinearChoice("aten", why)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight in oneDNN's blocked layout (an opaque tensor)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the weight packed by `pack_weight`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def packed_linear_available(dtype: torch.dtype) -> bool:
    """oneDNN packs `dtype` on this CPU (the probe's answer; for benchmarks and tests)."""
    return _NAMES.get(dtype) in probe_cpu_features().onednn_packs


def _onednn_ops_present() -> bool:
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packs(dtype: torch.dtype) -> bool:
    """Pack a tiny weight and run it: the ISA check torch makes, and the truth of it."""
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        out = packed_linear(torch.ones(2, 16, dtype=dtype), pack_weight(weight), None)
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False
    return bool((out == 16).all())


def _flag(probe: Callable[[], bool] | None) -> bool:
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False
