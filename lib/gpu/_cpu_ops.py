"""Element-wise steps of the torch forward that the C kernels do in one pass on the CPU.

Only where a measurement showed torch's version cost: SiLU(gate) * up over a prefill's
[T, 2I] projection was two passes and a temporary in torch. A 2048-token prefill of SmolLM2
(16 prompts of 128) took 1229 and 1244 ms with this kernel, 1475 and 1635 ms with torch's
(`perf/prefill_profile.py --prompts 16 --repeats 3 [--torch-silu]`, alternated twice).
float32 on the CPU with the kernels built; torch everywhere else (CUDA, bfloat16, no
compiler), with the same arithmetic to float32 rounding.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ._tiles import tiled_kernels


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[T, 2I] in [gate | up] order -> act(gate) * up [T, I]; `act` silu (SwiGLU) or
    gelu_tanh (GeGLU, Gemma's `gelu_pytorch_tanh`)."""
    if act == "silu":
        return silu_mul(gate_up)
    if act != "gelu_tanh":
        raise ValueError(f"activation {act!r} is not supported (silu, gelu_tanh)")
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] in [gate | up] order -> SiLU(gate) * up [T, I]."""
    lib = tiled_kernels() if gate_up.device.type == "cpu" else None
    if lib is None or gate_up.dtype != torch.float32 or gate_up.dim() != 2:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    x = gate_up.contiguous()
    t, width = x.shape
    out = torch.empty(t, width // 2, dtype=torch.float32)
    lib.trillm_silu_mul(
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(t),
        width // 2,
        ctypes.c_void_p(out.data_ptr()),
        torch.get_num_threads(),
    )
    return out
