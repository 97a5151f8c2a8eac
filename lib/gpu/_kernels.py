"""Which kernels a model runs with, chosen once at load from what the device can do.

The choice is a record (`KernelChoice`) because three places must show the same thing: the
server's start-up line, `/version`, and the `trillm:kernel_info` metric. It is made on the
worker (rank 0 reports it) and travels to the frontend in READY.
"""

from __future__ import annotations

import msgspec
import torch

from ._cpu_linear import CpuFeatures, choose_cpu_linear, probe_cpu_features
from ._quantized import choose_quantization


class KernelChoice(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The kernels in use: device, dtype, the linear path and why. Field order is ABI.

    `linear` is "onednn" (weights packed for oneDNN), "aten" (`F.linear`: MKL on CPU,
    cuBLAS on CUDA); `isa` is what the choice depended on (`CpuFeatures.summary()` on CPU,
    the GPU's name on CUDA); `attention` is the attention backend ("torch" or "triton");
    `quantization` is "gguf" (GGUF blocks kept, int4 kernel) or "none", and
    `quantization_reason` what that means; `decode` is how CPU decode steps run ("c": one C
    call per step, `_cpu_decode`; "torch (why)"; "" on CUDA).
    """

    device: str
    dtype: str
    linear: str
    isa: str = ""
    reason: str = ""
    attention: str = ""
    quantization: str = ""
    quantization_reason: str = ""
    decode: str = ""

    def describe(self) -> str:
        """One line for a log: "kernels: bfloat16 on cpu, linears aten (isa ...; reason),
        attention torch, quantization gguf (...)"."""
        why = "; ".join(part for part in (self.isa, self.reason) if part)
        line = f"kernels: {self.dtype} on {self.device}, linears {self.linear} ({why})"
        if self.attention:
            line += f", attention {self.attention}"
            if self.attention == "triton" and self.device == "cpu":
                line += " (Triton's interpreter on CPU: for correctness only, very slow)"
        if self.quantization not in ("", "none"):  # dense weights need no word
            line += f", quantization {self.quantization}"
            if self.quantization_reason:
                line += f" ({self.quantization_reason})"
        if self.decode:
            line += f", decode {self.decode}"
        return line


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
