"""A runner's start-up: the model built and loaded, its kernels chosen, its KV cache allocated,
its decode graphs captured (`RunnerStartup`, the part of `ModelRunner` that runs before steps).

Apart from the step (`_model_runner`) because it runs once and reads what the step never
does: the weights, the CPU probe's cache, the attention backend's choice. Each phase is timed
into the worker's `StartupLog`. Kernels are chosen before any weight is read, so an
unsupported explicit choice fails at once; on the CPU the C step is built before oneDNN
packs the dense weights (it tiles them), and the decode paths are measured at load, not over
the KV cache: the choice leaves a worker process before the cache is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import msgspec
import torch

from ...common.config import WorkerConfig
from ...common.speculative import SpeculativeConfig
from ...common.wire import KernelChoice
from ..attention._attention import AttentionBackend, TorchAttention
from ..cpu import _native
from ..cpu._cpu_decode import CpuStep, build_cpu_step
from ..cpu._cpu_linear import CpuFeatures
from ..cpu._decode_probe import decode_paths
from ..cpu._hugepages import huge_zeros
from ..cpu._prompt_linears import tiled_linears, use_tiles
from ..layers._parallel import TensorParallel
from ..loader._weights import Weights
from ..lora._lora import LoraManager
from ..models import family_for
from ..models._model_config import ModelConfig
from ..models.llama import KVCache, LlamaForCausalLM
from ..spec_decode._draft_model import DraftModel, MakeRunner
from ..worker._config import quantization_for
from ..worker._kv_budget import margin_note
from ..worker._startup_log import StartupLog
from ._cuda_graphs import DecodeGraphs
from ._input_batch import InputBatch
from ._kernels import choose_kernels, fused_kernels_for


@dataclass(slots=True)
class LoadedModel:
    """What `load_model` made: the model, its kernels, the C step (CPU) and the adapters."""

    model: LlamaForCausalLM
    kernels: KernelChoice
    cpu_step: CpuStep | None
    lora: LoraManager | None


def load_model(
    config: WorkerConfig,
    model_config: ModelConfig,
    tp: TensorParallel,
    device: torch.device,
    dtype: torch.dtype,
    weights: Weights | None,
    *,
    cpu_features: CpuFeatures | None,
    log: StartupLog,
) -> LoadedModel:
    """Build the model on `device` and load `weights` (None: random, for benchmarks)."""
    # Chosen first: an unsupported explicit choice fails before any weight is read.
    kernels = choose_kernels(
        device,
        dtype,
        config.cpu_linear,
        cpu_features,
        config.attention_backend_for(device),
        quantization_for(config, device),
    )
    torch.manual_seed(config.seed)
    family = family_for(model_config.model_type)
    assert family is not None  # ModelConfig.from_dict accepts only registered types
    model_class: type[LlamaForCausalLM] = family.load().MODEL
    with log.phase("model built and weights loaded"):
        with torch.device(device):
            model = model_class(model_config, tp, dtype)
        if weights is None:
            for param in model.parameters():
                param.data.normal_(0.0, 0.02)
        else:
            model.load_weights(weights, keep_quantized=kernels.quantization == "gguf")
    lora = None
    if config.enable_lora:
        lora = LoraManager(
            model,
            model_config,
            tp,
            max_loras=config.max_loras,
            max_rank=config.max_lora_rank,
            max_cpu_loras=config.num_cpu_loras,
            max_rows=config.max_num_seqs,
            dtype=dtype,
            device=device,
            cache_dir=config.lora_cache_dir,
        )
    cpu_step = None
    if device.type == "cpu":  # before packing: it tiles the dense weights
        with log.phase("C decode step") as notes:
            built = len(_native.BUILT)
            cpu_step, decode = build_cpu_step(model, config, config.block_size)
            compiled = _native.BUILT[built:]
            notes.append(f"(built {', '.join(compiled)})" if compiled else "(cached kernels)")
            if cpu_step is None:
                notes[-1] = "(off)"
        kernels = msgspec.structs.replace(kernels, decode=decode)
    if kernels.linear == "onednn":
        with log.phase("linears packed for oneDNN"):
            model.pack_linears()
    if fused_kernels_for(device, config.attention_backend_for(device)):
        model.use_fused()
    model = model.eval()
    if cpu_step is not None and config.cpu_decode == "auto":
        kernels = measure_decode_paths(cpu_step, model, kernels, config, log)
    return LoadedModel(model, kernels, cpu_step, lora)


def measure_decode_paths(
    step: CpuStep,
    model: LlamaForCausalLM,
    kernels: KernelChoice,
    config: WorkerConfig,
    log: StartupLog,
) -> KernelChoice:
    """Time the C step against the torch forward (packed as it will serve) per decode step
    size, or read the last start-up's timings (`_decode_probe`); `kernels` saying which path
    takes which size (`KernelChoice.decode`)."""
    with log.phase("decode paths") as notes:
        step.paths = decode_paths(
            step, model, isa=kernels.isa, linear=kernels.linear, kv_budget=config.kv_cache_bytes
        )
        measured = "measured" if step.paths.timings else "not measured"
        notes.append("read from the cache" if step.paths.cached else measured)
        if step.paths.prompt is not None and step.paths.prompt.tiles_win:
            use_tiles(tiled_linears(step, model))  # oneDNN's copies let go
    return msgspec.structs.replace(kernels, decode=step.describe())


def kv_bytes_per_block(
    model_config: ModelConfig, tp: TensorParallel, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block of the model takes on this rank, over every layer (K and V)."""
    heads = tp.split(model_config.num_kv_heads, "num_key_value_heads")
    return model_config.kv_block_bytes(
        block_size, heads, torch.empty(0, dtype=dtype).element_size()
    )


def kv_cache_tensors(
    model_config: ModelConfig,
    tp: TensorParallel,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """`num_blocks` blocks of K and V per layer, zeroed; on the CPU on huge pages."""
    heads = tp.split(model_config.num_kv_heads, "num_key_value_heads")
    shape = (num_blocks, block_size, heads, model_config.head_dim)
    layers = range(model_config.num_layers)
    if device.type == "cpu":  # the C step streams it: on huge pages (`_hugepages`)
        caches = [(huge_zeros(shape, dtype), huge_zeros(shape, dtype)) for _ in layers]
        for k, v in caches:  # its pages held from now, as torch.zeros held them: the
            k.zero_()  # budget is taken at start-up (and given back by sleep), and no
            v.zero_()  # step faults them in
        return caches
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in layers
    ]


def attention_backend(
    config: WorkerConfig,
    model_config: ModelConfig,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionBackend:
    """The configured attention backend over this rank's heads."""
    kv_heads = tp.split(model_config.num_kv_heads, "num_key_value_heads")
    if config.attention_backend_for(device) == "triton":
        from ..attention._attention_triton import (
            TritonAttention,  # imports triton: only when chosen
        )

        heads = tp.split(model_config.num_heads, "num_attention_heads")
        return TritonAttention(heads, kv_heads, model_config.head_dim, config.block_size, device)
    block_numel = config.block_size * kv_heads * model_config.head_dim
    return TorchAttention(config.block_size, block_numel, dtype, device)


class RunnerStartup:
    """`ModelRunner`'s start-up methods, over the state its `__init__` sets (declared here)."""

    config: WorkerConfig
    model_config: ModelConfig
    tp: TensorParallel
    device: torch.device
    dtype: torch.dtype
    block_size: int
    inputs: InputBatch
    kv_caches: list[KVCache]
    attention: AttentionBackend | None
    graphs: DecodeGraphs | None
    cpu_step: CpuStep | None
    model: LlamaForCausalLM | None
    lora: LoraManager | None
    kernels: KernelChoice | None
    speculative: SpeculativeConfig | None
    drafter: DraftModel | None
    _cpu_features: CpuFeatures | None

    def load_model(self, weights: Weights | None, log: StartupLog | None = None) -> None:
        """Build the model on the device and load `weights` (None: random, for benchmarks),
        timing each phase into `log`."""
        log = log or StartupLog(enabled=False)
        loaded = load_model(
            self.config,
            self.model_config,
            self.tp,
            self.device,
            self.dtype,
            weights,
            cpu_features=self._cpu_features,
            log=log,
        )
        self.model, self.kernels = loaded.model, loaded.kernels
        self.cpu_step, self.lora = loaded.cpu_step, loaded.lora
        spec = self.speculative
        if spec is not None and spec.model is not None:
            with log.phase("draft model loaded"):
                self.drafter = DraftModel.load(
                    self.config,
                    spec.model,
                    self.tp,
                    self.device,
                    self.inputs,
                    self.model_config.vocab_size,
                    make_runner=cast(MakeRunner, type(self)),  # a ModelRunner
                )

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on this rank, over every layer (K and V), the draft
        model's share included."""
        draft = 0 if self.drafter is None else self.drafter.kv_bytes_per_block()
        cfg, tp = self.model_config, self.tp
        return kv_bytes_per_block(cfg, tp, self.block_size, self.dtype) + draft

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks of K and V per layer."""
        if self.attention is None:
            self.attention = attention_backend(
                self.config, self.model_config, self.tp, self.dtype, self.device
            )
        self.bind_kv_cache(
            kv_cache_tensors(
                self.model_config, self.tp, num_blocks, self.block_size, self.dtype, self.device
            )
        )
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)

    def bind_kv_cache(self, kv_caches: list[KVCache]) -> None:
        """Make `kv_caches` the cache the steps run over (the C step's too; [] unbinds it)."""
        self.kv_caches = kv_caches
        if self.cpu_step is not None and kv_caches:
            self.cpu_step.bind(kv_caches)
        elif self.cpu_step is not None:
            self.cpu_step.unbind()

    def free_kv_cache(self) -> int:
        """Drop the KV cache and the graphs over it (they hold its addresses, and the
        weights'); return its size in blocks (0: there was none), for `Worker.wake_up`."""
        num_blocks = int(self.kv_caches[0][0].shape[0]) if self.kv_caches else 0
        self.graphs = None
        if self.drafter is not None:
            self.drafter.free_kv_cache()
        self.bind_kv_cache([])
        return num_blocks

    def graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes `capture_cuda_graphs` will capture on CUDA (() if none)."""
        from ..attention._attention_triton import TritonAttention

        if self.tp.world_size > 1 or not isinstance(self.attention, TritonAttention):
            return ()
        return tuple(sorted(self.config.cuda_graph_sizes()))

    def capture_cuda_graphs(self, *, off_cuda: bool = False, margin: int = 0) -> str:
        """Capture decode graphs (after `init_kv_cache`); returns the line to log, with the
        pool's size against the `margin` kept for it when the KV cache was sized.

        `off_cuda` builds the static, padded buffers on CPU too (no graph: tests).
        """
        sizes = self.config.cuda_graph_sizes()
        if self.device.type != "cuda" and not off_cuda:
            return "cuda graphs: none (not on CUDA)"
        if not sizes:
            return "cuda graphs: none (--enforce-eager)"
        if self.tp.world_size > 1:
            return "cuda graphs: none (tensor parallel steps run eager)"
        from ..attention._attention_triton import TritonAttention

        if not isinstance(self.attention, TritonAttention):
            return (
                "cuda graphs: none (the torch attention backend's shapes change with each "
                "step; use --attention-backend triton)"
            )
        assert self.model is not None
        max_blocks = self.inputs.block_table.shape[1]
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.attention, sizes, max_blocks, self.device
        )
        report = graphs.capture()
        self.graphs = graphs
        return report.describe() + margin_note(report.bytes, margin)
