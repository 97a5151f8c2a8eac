"""Element-wise steps of the torch forward that the C kernels do in one pass on the CPU.

Only where a measurement showed torch's version cost: SiLU(gate) * up over a prefill's
[T, 2I] projection was two passes and a temporary in torch. A 2048-token prefill of SmolLM2
(16 prompts of 128) took 1229 and 1244 ms with this kernel, 1475 and 1635 ms with torch's
(`perf/prefill_profile.py --prompts 16 --repeats 3 [--torch-silu]`, alternated twice).
The residual add and the RMSNorm after it (`CpuNorms`): torch made them six passes over
[T, hidden] (add, pow, mean, rsqrt, mul, mul): 1.141 ms against C's 0.474 on [2048, 576],
and a 16 x 128 step 1898.4 against 1860.2 ms (`perf/norm_bench.py`, `perf/prefill_profile.py
--ab-norm`, quiet, medians; `perf/README.md`).
float32 and bfloat16 on the CPU with the kernels built (bfloat16 rounded where torch's ops
round: the residual, the normed row before Llama's weight, SiLU before the product); torch
everywhere else (CUDA, float16, no compiler), with the same arithmetic to float32 rounding.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ._tiles import tiled_kernels

# Elements below which a kernel runs on the calling thread alone, as torch's own element-wise
# ops do (at::internal::GRAIN_SIZE): on a loaded machine a parallel region waits for its
# slowest thread, and a descheduled one cost a 32-row step's norm 0.05-7.5 ms.
GRAIN = 32768
_C_DTYPES = (torch.float32, torch.bfloat16)


def threads_for(numel: int) -> int:
    """OpenMP threads for a kernel over `numel` elements: torch's, or 1 below `GRAIN`."""
    return torch.get_num_threads() if numel >= GRAIN else 1


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
    """[T, 2I] in [gate | up] order -> SiLU(gate) * up [T, I]; in bfloat16 with torch's two
    roundings (SiLU's, then the product's)."""
    lib = tiled_kernels() if gate_up.device.type == "cpu" else None
    if lib is None or gate_up.dtype not in _C_DTYPES or gate_up.dim() != 2:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    x = gate_up.contiguous()
    t, width = x.shape
    out = torch.empty(t, width // 2, dtype=x.dtype)
    kernel = lib.trillm_silu_mul if x.dtype == torch.float32 else lib.trillm_silu_mul_bf16
    kernel(
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(t),
        width // 2,
        ctypes.c_void_p(out.data_ptr()),
        threads_for(x.numel()),
    )
    return out


class CpuNorms:
    """RMSNorm, and the residual add + RMSNorm, in one C pass a row (`csrc/tl_norm.h`): the
    CPU's `NormOps` (`_layers`), as `_fused_kernels.FusedOps` is CUDA's. float32 and bfloat16."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
    ) -> torch.Tensor:
        """RMSNorm of the rows of x by (offset + weight)."""
        return self._norm(x, None, weight, eps, offset)[0]

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of x + residual, x + residual): the next block's input and residual."""
        return self._norm(x, residual, weight, eps, offset)

    def _norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        offset: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.shape[-1]
        rows = x.reshape(-1, h).contiguous()
        scale = (weight.float() + offset if offset else weight.float()).contiguous()
        out = torch.empty_like(rows)
        total = rows if residual is None else torch.empty_like(rows)
        res = None if residual is None else residual.reshape(-1, h).contiguous()
        if rows.shape[0]:
            head = (
                ctypes.c_void_p(rows.data_ptr()),
                None if res is None else ctypes.c_void_p(res.data_ptr()),
                ctypes.c_void_p(scale.data_ptr()),
                ctypes.c_int64(rows.shape[0]),
                h,
                ctypes.c_float(eps),
            )
            tail = (
                ctypes.c_void_p(out.data_ptr()),
                ctypes.c_void_p(total.data_ptr()),
                threads_for(rows.numel()),
            )
            if rows.dtype == torch.float32:
                self.lib.trillm_add_rms_norm(*head, *tail)
            else:  # Llama's order casts the normed row before the weight; Gemma's does not
                self.lib.trillm_add_rms_norm_bf16(*head, int(not offset), *tail)
        return out.view(x.shape), total.view(x.shape)


def cpu_norms(x: torch.Tensor) -> CpuNorms | None:
    """The C norms for tensors like x (float32 or bfloat16 on the CPU, kernels built), else
    None: torch's ops stay (CUDA, float16, no compiler)."""
    if x.device.type != "cpu" or x.dtype not in _C_DTYPES:
        return None
    lib = tiled_kernels()
    return None if lib is None else CpuNorms(lib)
