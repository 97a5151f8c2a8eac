"""The configuration of the device side (`WorkerConfig`), in a module without torch.

Both processes read it: the frontend parses the flags into it and sends it to the engine inside
`EngineConfig`; the worker resolves "auto" against its device (`trillm.gpu._config`). It lives
outside `trillm.gpu` so that the API process, which only builds and sends it, never loads torch
(DESIGN.md §8, "the API process is lean").
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
CPU_LINEAR = ("auto", "onednn", "aten")  # `trillm.gpu._cpu_linear`
QUANTIZATIONS = ("auto", "gguf", "none")  # `trillm.gpu._quantized`
MAX_CUDA_GRAPH_BATCH = 512
_FAULT = re.compile(r"(forward|token):\d+:\d+")


class WorkerConfigError(ValueError):
    """A worker setting is out of range; the message names the setting and the limit."""


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to load a model and size its KV cache.

    `dtype="auto"` is float32 on CPU and bfloat16 on CUDA. A CPU without AVX-512 BF16 or AMX
    runs a bfloat16 matmul 3-30x slower than float32; where it has them, `dtype="bfloat16"` is
    faster but less exact (`perf/linear_bench.py` shows both). Which linear kernels run is
    probed at load (`cpu_linear`, `_cpu_linear.py`).
    """

    model: str  # a Hugging Face model directory or a GGUF file
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_bytes: int = 1 << 30  # the KV budget on CPU, where free memory is not measurable
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    # "auto": linear weights packed for oneDNN where this CPU can run the dtype (2x on
    # AVX-512; `_cpu_linear`), plain F.linear elsewhere; "onednn": packed or an error at load;
    # "aten": plain F.linear (MKL), for comparison.
    cpu_linear: str = "auto"
    # "auto": triton on CUDA, torch on CPU; "torch": the SDPA reference; "triton": the paged
    # kernel (`_attention_triton`), on CPU through Triton's interpreter (correctness only).
    attention_backend: str = "auto"
    # No CUDA graphs: every decode step runs eager (graphs are captured on CUDA only).
    enforce_eager: bool = False
    # "gguf": a GGUF file's Q4_0 / Q4_1 weights stay int4 in memory and Q8_0 ones become
    # float16, multiplied by torch's weight-only CPU kernels (`_quantized`); "none":
    # dequantised to `dtype`; "auto": gguf for a GGUF file on the CPU, else none. (vLLM's
    # names for the flag and the values.)
    quantization: str = "auto"
    # Test hook: "forward:RANK:STEP" raises InjectedFault inside the model's forward on that
    # rank at that step (counting from 0), so death reporting can be tested end to end;
    # "token:RANK:ID" raises it in every step whose input holds token ID (a poison request).
    inject_fault: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise WorkerConfigError(
                f"load_format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise WorkerConfigError(
                f"dtype {self.dtype!r} is not auto or one of {', '.join(DTYPE_NAMES)}"
            )
        if self.cpu_linear not in CPU_LINEAR:
            raise WorkerConfigError(
                f"cpu_linear {self.cpu_linear!r} is not one of {', '.join(CPU_LINEAR)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise WorkerConfigError(
                f"attention_backend {self.attention_backend!r} is not one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise WorkerConfigError(
                f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
            )
        if self.quantization == "gguf" and not self.is_gguf():
            raise WorkerConfigError(
                f"quantization 'gguf' needs a GGUF file with its weights, but model "
                f"{self.model!r} is loaded as {self.load_format!r}; give a .gguf file, or "
                f"use quantization 'none'"
            )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise WorkerConfigError(
                f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise WorkerConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.inject_fault is not None and not _FAULT.fullmatch(self.inject_fault):
            raise WorkerConfigError(
                f"inject_fault must look like 'forward:RANK:STEP' or 'token:RANK:ID', got "
                f"{self.inject_fault!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if getattr(self, name) <= 0:
                raise WorkerConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def device_name(self) -> str:
        """`device` with "auto" resolved as the worker will resolve it: "cuda" when the driver
        shows a device (`cuda_present`), else "cpu"."""
        if self.device == "auto":
            return "cuda" if cuda_present() else "cpu"
        return self.device

    def attention_backend_for(self, device: torch.device) -> str:
        """The backend `auto` resolves to on `device` (a `torch.device`, or anything with its
        `type`): triton on CUDA, torch elsewhere."""
        if self.attention_backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.attention_backend

    def is_gguf(self) -> bool:
        """The weights are read from a GGUF file (as `open_model` decides; not `dummy`)."""
        gguf = self.load_format == "gguf" or Path(self.model).suffix == ".gguf"
        return gguf and self.load_format != "dummy"

    def cuda_graph_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes captured as CUDA graphs, as vLLM: 1, 2, 4, 8, then every 8 up
        to max_num_seqs (capped at 512); the last covers max_num_seqs. Empty when eager."""
        if self.enforce_eager:
            return ()
        top = min(self.max_num_seqs, MAX_CUDA_GRAPH_BATCH)
        sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top + 8, 8))
        return tuple(sorted({min(s, top) if s >= top else s for s in sizes}))

    def fault_at(self) -> tuple[str, int, int] | None:
        """(kind, rank, step or token id) of the injected fault, if the test hook is set."""
        if self.inject_fault is None:
            return None
        kind, rank, at = self.inject_fault.split(":")
        return kind, int(rank), int(at)


@functools.cache
def cuda_present() -> bool:
    """Whether this machine has a CUDA device the driver will show, asked of the driver itself
    (libcuda's `cuInit`, `cuDeviceGetCount`), so that the API process need not load torch to
    resolve `device="auto"` (torch's own `cuda.is_available` asks the same driver)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0
