"""What "auto" in a `WorkerConfig` means on this worker's device: the torch side of the config.

`WorkerConfig` itself lives in `trillm.common.config`, without torch, because the API process builds
it; resolving it against a device needs torch, and so lives here.
"""

from __future__ import annotations

import torch

from ...common.config import WorkerConfig
from ..quant._quantized import quantized_kernels_run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_device(config: WorkerConfig) -> torch.device:
    """The device `config.device` names; "auto" is CUDA when there is one."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def torch_dtype(config: WorkerConfig, device: torch.device) -> torch.dtype:
    """The weights' dtype; "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def quantization_for(config: WorkerConfig, device: torch.device) -> str:
    """What `auto` resolves to: gguf for a GGUF file on a CPU where the kernels run
    (`quantized_kernels_run`, probed once), none otherwise."""
    if config.quantization == "auto":
        kept = config.is_gguf() and device.type == "cpu" and quantized_kernels_run()
        return "gguf" if kept else "none"
    return config.quantization
