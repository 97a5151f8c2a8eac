"""Which kernels a model runs with, chosen once at load from what the device can do.

The choice is a record (`KernelChoice`) because three places must show the same thing: the
server's start-up line, `/version`, and the `trillm:kernel_info` metric. It is made on the
worker (rank 0 reports it) and travels to the frontend in READY.
"""

from __future__ import annotations

import torch

from ...common.wire import KernelChoice
from ..cpu._cpu_linear import CpuFeatures, choose_cpu_linear, probe_cpu_features
from ..quant._quantized import choose_quantization


def choose_kernels(
    device: torch.device,
    dtype: torch.dtype,
    cpu_linear: str,
    cpu_features: CpuFeatures | None = None,
    attention: str = "",
    quantization: str = "none",
) -> KernelChoice:
    """The kernels for a model in `dtype` on `device`.

    Args:
        cpu_linear: "auto", "onednn" or "aten" (`WorkerConfig.cpu_linear`); CPU only.
        cpu_features: the CPU's answer to use instead of probing it (tests force either
            branch with it); None probes this CPU, once per process.
        attention: the attention backend in use, recorded as it is.
        quantization: "gguf" or "none" (`WorkerConfig.quantization_for`, auto resolved).

    Raises:
        CpuLinearUnsupportedError: "onednn" was asked for a dtype this CPU cannot pack.
        QuantizationUnsupportedError: "gguf" where its kernel cannot run.
    """
    name = str(dtype).removeprefix("torch.")
    quant = choose_quantization(quantization, device)
    if device.type != "cpu":
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return KernelChoice(str(device), name, "aten", gpu, "F.linear (cuBLAS)", attention, *quant)
    features = cpu_features if cpu_features is not None else probe_cpu_features()
    linear = choose_cpu_linear(cpu_linear, dtype, features)
    return KernelChoice(
        "cpu", name, linear.path, features.summary(), linear.reason, attention, *quant
    )


def fused_kernels_for(device: torch.device, attention: str) -> bool:
    """Whether the model runs the fused Triton kernels (`_fused_kernels`): on CUDA with the
    triton attention backend (the rotary kernel writes its cache), where they cut a decode
    layer from 25 launches to 9. The CPU keeps its torch ops and C step, whose numbers and
    speed the kernels would only change (interpreted, they are slow)."""
    return device.type == "cuda" and attention == "triton"
