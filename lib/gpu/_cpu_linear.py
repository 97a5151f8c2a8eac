"""Linear layers on the CPU through oneDNN, with each weight packed once at load.

Why: PyTorch's CPU `F.linear` calls MKL's sgemm, and MKL runs only its AVX2 kernels on AMD
processors, whatever they support. oneDNN (which PyTorch also ships) picks its kernels from the
CPU's own feature flags, so on an AVX-512 machine it does twice the FLOPs per cycle. Packing the
weight once into oneDNN's blocked layout also removes the per-call packing sgemm does, which
made sgemm stall on weights streamed from memory. On the 2-core AMD EPYC of our CI machines
(AVX-512, where MKL stays on AVX2), 30 layers of SmolLM2-135M's float32 linears took, per
forward: 146 -> 62 ms at 128 tokens, 52 -> 22 ms at 32, 24.8 -> 11.6 ms at 1
(`perf/linear_bench.py`, which measures it on any machine).

The packed weight is an opaque `torch._mkldnn` tensor: it is used only through
`packed_linear`, and the dense copy is dropped once packed (loading is over by then).
"""

from __future__ import annotations

import torch

BACKENDS = ("onednn", "aten")


def packed_linear_available(dtype: torch.dtype) -> bool:
    """oneDNN is built in, has the ops, and packs this dtype (float32, bfloat16)."""
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and dtype in (torch.float32, torch.bfloat16)
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight in oneDNN's blocked layout (an opaque tensor)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the weight packed by `pack_weight`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out
