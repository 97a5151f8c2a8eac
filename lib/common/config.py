"""The configuration of the device side (`WorkerConfig`), in a module without torch; each of
its fields that is a `trillm serve` flag declares it (`trillm.common.flags`).

Both processes read it: the frontend parses the flags into it and sends it to the engine inside
`EngineConfig`; the worker resolves "auto" against its device (`trillm.gpu.worker._config`). It
lives outside `trillm.gpu` so that the API process, which only builds and sends it, never loads
torch (DESIGN.md §8, "the API process is lean").
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .flags import flag
from .speculative import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
CPU_LINEAR = ("auto", "onednn", "aten")  # `trillm.gpu.cpu._cpu_linear`
CPU_DECODE = ("auto", "c", "torch")  # `trillm.gpu.cpu._decode_probe`
QUANTIZATIONS = ("auto", "gguf", "none")  # `trillm.gpu.quant._quantized`
MAX_CUDA_GRAPH_BATCH = 512
MAX_LORA_RANK = 64
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

    model: str  # a Hugging Face model directory or a GGUF file (the CLI's positional MODEL)
    load_format: str = field(default="auto", metadata=flag("--load-format", choices=LOAD_FORMATS))
    dtype: str = field(default="auto", metadata=flag("--dtype", choices=("auto", *DTYPE_NAMES)))
    device: str = field(default="auto", metadata=flag("--device", help="auto, cpu, cuda, cuda:N"))
    block_size: int = field(default=16, metadata=flag("--block-size"))
    max_num_seqs: int = field(default=256, metadata=flag("--max-num-seqs"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag("--max-num-batched-tokens"))
    # While decodes run, each step earns pooling prompts (embeddings) this many tokens per
    # running decode, spent on whole prompts (credit kept up to a step's budget; generation
    # prompts are not held back but spend it too), so an embeddings flood cannot stretch the
    # streams' time per output token; 0: no cap (vLLM's way: prompts fill the budget's rest).
    # The default is measured: perf/README.md, `prefill_cap_bench.py`.
    max_prefill_tokens_per_decode: int = field(
        default=1,
        metadata=flag(
            "--max-prefill-tokens-per-decode",
            help="while decodes run, embedding (pooling) prompt tokens each running decode "
            "earns a step, spent on whole prompts; generation prompts are not held back but "
            "spend them too; 0: no cap, prompts fill the token budget's rest",
        ),
    )
    # None: the model's max_position_embeddings
    max_model_len: int | None = field(default=None, metadata=flag("--max-model-len"))
    # The KV budget on CPU, where free memory is not measurable.
    kv_cache_bytes: int = field(
        default=1 << 30,
        metadata=flag("--kv-cache-memory-bytes", help="the KV cache budget on CPU"),
    )
    gpu_memory_utilization: float = field(default=0.9, metadata=flag("--gpu-memory-utilization"))
    seed: int = field(default=0, metadata=flag("--seed"))
    # "auto": linear weights packed for oneDNN where this CPU can run the dtype (2x on
    # AVX-512; `_cpu_linear`), plain F.linear elsewhere; "onednn": packed or an error at load;
    # "aten": plain F.linear (MKL), for comparison.
    cpu_linear: str = field(
        default="auto",
        metadata=flag(
            "--cpu-linear",
            choices=CPU_LINEAR,
            help="CPU linear kernels: auto (oneDNN where this CPU runs the dtype, else "
            "F.linear), onednn (or fail at load), aten (F.linear)",
        ),
    )
    # Which path a CPU decode step (one token per sequence) takes: "auto" times the C step
    # against the torch forward with C's attention at start-up, per batch size, and keeps the
    # faster (cached; `_decode_probe`); "c": the C step up to its 64 sequences; "torch": never
    # the C step (C still attends). Prompts are the same under all three.
    cpu_decode: str = field(
        default="auto",
        metadata=flag(
            "--cpu-decode",
            choices=CPU_DECODE,
            help="CPU decode steps: auto (the faster of the C step and the torch forward, "
            "timed at start-up per batch size and cached), c (the C step up to 64 sequences), "
            "torch (the torch forward with C's attention)",
        ),
    )
    # "auto": triton on CUDA, torch on CPU; "torch": the SDPA reference; "triton": the paged
    # kernel (`_attention_triton`), on CPU through Triton's interpreter (correctness only).
    attention_backend: str = field(
        default="auto",
        metadata=flag(
            "--attention-backend",
            choices=ATTENTION_BACKENDS,
            help="paged attention: auto (triton on CUDA, torch on CPU), torch (SDPA reference), "
            "triton (the paged kernel; on CPU through Triton's interpreter, for correctness "
            "only)",
        ),
    )
    # No CUDA graphs: every decode step runs eager (graphs are captured on CUDA only).
    enforce_eager: bool = field(
        default=False,
        metadata=flag(
            "--enforce-eager",
            help="no CUDA graphs, and on the CPU no C decode step: decode steps run the torch "
            "forward eagerly",
        ),
    )
    # "gguf": a GGUF file's Q4_0 / Q4_1 weights stay int4 in memory and Q8_0 ones become
    # float16, multiplied by torch's weight-only CPU kernels (`_quantized`); "none":
    # dequantised to `dtype`; "auto": gguf for a GGUF file on the CPU, else none. (vLLM's
    # names for the flag and the values.)
    quantization: str = field(
        default="auto",
        metadata=flag(
            "--quantization",
            "-q",
            choices=QUANTIZATIONS,
            help="gguf: keep a GGUF file's Q4_0/Q4_1/Q8_0 weights quantized in memory (int4 "
            "and float16 CPU kernels, bfloat16 activations for int4); none: dequantise them to "
            "--dtype; auto: gguf for a GGUF file on the CPU, else none. With no MODEL, gguf "
            "serves the built-in model's GGUF file, auto and none its float32 conversion",
        ),
    )
    # LoRA adapters (vLLM's flags): `max_loras` fixed slots on the device (the distinct
    # adapters one step may hold), each of rank up to `max_lora_rank`; `max_cpu_loras`
    # adapters kept in host memory, least recently used dropped (None: max_loras).
    enable_lora: bool = field(
        default=False, metadata=flag("--enable-lora", help="serve LoRA adapters")
    )
    max_loras: int = field(
        default=1,
        metadata=flag("--max-loras", help="LoRA adapters one step may hold (device slots)"),
    )
    max_lora_rank: int = field(
        default=16, metadata=flag("--max-lora-rank", help=f"up to {MAX_LORA_RANK}")
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata=flag(
            "--max-cpu-loras",
            help="LoRA adapters kept in host memory, LRU (default: --max-loras)",
        ),
    )
    # Where each rank keeps the checked copies of the adapters' files (`_lora_files`), read
    # again instead of the user's path; set by the frontend, which owns the directory (it
    # outlives an engine, so a restarted one reads the same bytes). "": none is kept.
    lora_cache_dir: str = ""
    # Speculative decoding (`trillm.common.speculative`): JSON with vLLM's field names, parsed and
    # checked here, at the edge; None: off.
    speculative_config: str | None = field(
        default=None,
        metadata=flag(
            "--speculative-config",
            metavar="JSON",
            help='speculative decoding, vLLM\'s fields: {"method": "ngram", '
            '"num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B} or '
            '{"method": "draft_model", "model": PATH, "num_speculative_tokens": K}; '
            '"disable_by_batch_size": N turns it off in steps where more requests run',
        ),
    )
    # Test hook: "forward:RANK:STEP" raises InjectedFault inside the model's forward on that
    # rank at that step (counting from 0), so death reporting can be tested end to end;
    # "token:RANK:ID" raises it in every step whose input holds token ID (a poison request).
    inject_fault: str | None = field(default=None, metadata=flag("--inject-fault", hidden=True))

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
        if self.cpu_decode not in CPU_DECODE:
            raise WorkerConfigError(
                f"cpu_decode {self.cpu_decode!r} is not one of {', '.join(CPU_DECODE)}"
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
        self.speculative()  # SpeculativeConfigError naming the field, at start-up
        if self.max_prefill_tokens_per_decode < 0:
            raise WorkerConfigError(
                f"max_prefill_tokens_per_decode must be >= 0 (0: no cap), got "
                f"{self.max_prefill_tokens_per_decode}"
            )
        self._check_lora()

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise WorkerConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise WorkerConfigError(
                f"max_lora_rank must be in 1..{MAX_LORA_RANK}, got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise WorkerConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                f"an adapter in a device slot is kept in host memory too"
            )

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in host memory (`max_cpu_loras`, default `max_loras`)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed `speculative_config` (None: off).

        Raises:
            SpeculativeConfigError: it is not valid; the message names the field.
        """
        return parse_speculative_config(self.speculative_config)

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
