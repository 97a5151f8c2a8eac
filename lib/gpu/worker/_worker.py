"""A worker: one tensor-parallel rank's device, process group, model runner and KV cache.

Start-up order (DESIGN.md §7): device and ``torch.distributed`` first, then a memory snapshot,
then the model, so whatever the collectives allocate is already counted when the KV cache is
sized. The executor calls, in order: `init_device`, `load_model`, `num_available_kv_blocks`
(the minimum over ranks is used), `init_kv_cache`, then `execute` once per step; `sleep` and
`wake_up` between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import gc
import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from ...common.config import WorkerConfig
from ...common.wire import KernelChoice, LoraModule
from .._step_batch import NewRequest, RunnerOutput, StepBatch
from ..layers._parallel import TensorParallel
from ..loader._weights import open_model
from ..runner._ahead import PendingOutput
from ..runner._model_runner import ModelRunner
from ._config import torch_device
from ._kv_budget import DeviceMemory, kv_budget
from ._startup_log import StartupLog


class KVCacheTooSmallError(RuntimeError):
    """Not even one KV block fits in the memory budget."""


class Worker:
    """Tensor-parallel rank `rank` of `world_size`."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        dist_init_method: str | None = None,
        local_rank: int | None = None,
    ) -> None:
        """`local_rank`: this rank's index on its machine (its GPU); default `rank` (one node)."""
        if world_size > 1 and dist_init_method is None:
            raise ValueError("tensor parallelism needs dist_init_method (e.g. tcp://host:port)")
        self.config = config
        self.rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        self.world_size = world_size
        self.dist_init_method = dist_init_method
        self.device = torch.device("cpu")
        self.tp = TensorParallel()
        self.free_memory_at_start = 0
        self.graph_margin = 0  # kept free for the decode graphs at sizing (`_kv_budget`)
        self._runner: ModelRunner | None = None
        self._asleep_blocks: int | None = None  # the KV cache's size while asleep
        self._weights_offloaded = False  # sleep level 2 on CUDA: the weights are on the host
        self.log = StartupLog(enabled=rank == 0)  # one rank's lines say it for all

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the worker has no model yet: call load_model() first")
        return self._runner

    def init_device(self) -> None:
        """Pick the device, join the process group (gloo on CPU, NCCL on CUDA), snapshot memory;
        on CPU, keep freed activations in malloc's heap (`keep_activations_in_heap`)."""
        with self.log.phase("device and process group") as notes:
            self._init_device()
            if self.device.type == "cpu" and keep_activations_in_heap():
                notes.append(f"(malloc: heap up to {MMAP_THRESHOLD >> 20} MiB blocks)")

    def _init_device(self) -> None:
        device = torch_device(self.config)
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + self.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        if self.world_size > 1:
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                init_method=self.dist_init_method,
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=120),
            )
            self.tp = TensorParallel(self.rank, self.world_size)
            self.tp.all_reduce(torch.zeros(1, device=device))  # collectives allocate now
        if device.type == "cuda":
            self.free_memory_at_start = torch.cuda.mem_get_info(device)[0]

    @property
    def kernels(self) -> KernelChoice:
        """The kernels `load_model` chose for this rank's device and dtype."""
        kernels = self.runner.kernels
        if kernels is None:
            raise RuntimeError("the worker has no model yet: call load_model() first")
        return kernels

    def load_model(self) -> None:
        """Read the model's config, build it on the device, load this rank's weight shards."""
        with self.log.phase("checkpoint opened"):
            model_config, weights = open_model(self.config.model, self.config.load_format)
        runner = ModelRunner(self.config, model_config, self.tp, self.device)
        runner.load_model(weights, self.log)
        self._runner = runner

    def num_available_kv_blocks(self) -> int:
        """How many KV blocks fit: the CPU byte budget, or on CUDA what is free after a
        profile forward of `max_num_batched_tokens` tokens, times `gpu_memory_utilization`.

        Raises:
            KVCacheTooSmallError: not one block fits; the message says what to change.
        """
        per_block = self.runner.kv_bytes_per_block()
        if self.device.type == "cuda":
            memory = self.profile_memory()
            self.graph_margin = memory.graph_margin
            budget = kv_budget(memory, self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_bytes
        blocks = budget // per_block
        if blocks < 1:
            raise KVCacheTooSmallError(
                f"the KV cache does not fit: one block of {self.config.block_size} tokens needs "
                f"{per_block} bytes on rank {self.rank} and the budget is {budget} bytes; raise "
                f"kv_cache_bytes (--kv-cache-memory-bytes, CPU) or gpu_memory_utilization "
                f"(--gpu-memory-utilization, CUDA), or use a smaller model"
            )
        return int(blocks)

    def profile_memory(self) -> DeviceMemory:
        """The profile runs' numbers (`_kv_budget`): a full token budget's forward, then an
        eager one of the largest captured decode batch, whose peak sizes the graphs' pool."""
        device = self.device
        torch.cuda.reset_peak_memory_stats(device)
        with self.log.phase("profile run (peak activation memory)"):
            self.profile_run()
        sizes = self.runner.graph_sizes()
        graph_activations = 0
        if sizes:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)  # reserved memory never shrinks
            with self.log.phase(f"profile run of a {sizes[-1]}-decode graph batch"):
                self.profile_run(num_seqs=sizes[-1], seq_len=1)
            graph_activations = max(1, torch.cuda.max_memory_allocated(device) - before)
        return DeviceMemory(
            total=torch.cuda.mem_get_info(device)[1],
            free_at_start=self.free_memory_at_start,
            peak_reserved=torch.cuda.max_memory_reserved(device),
            graph_activations=graph_activations,
        )

    def profile_run(self, *, num_seqs: int = 0, seq_len: int = 0) -> None:
        """One forward of a full token budget, so peak activation memory can be measured.

        Uses a throw-away KV cache just large enough, and leaves no request behind.
        """
        runner, config = self.runner, self.config
        total = config.max_num_batched_tokens
        seq_len = seq_len or min(total, runner.max_model_len - 1)  # room for a sampled token
        num_seqs = num_seqs or min(config.max_num_seqs, -(-total // seq_len))
        blocks_per_seq = -(-seq_len // config.block_size)
        saved = runner.kv_caches
        runner.init_kv_cache(num_seqs * blocks_per_seq)
        batch = _profile_batch(num_seqs, seq_len, blocks_per_seq)
        try:
            runner.execute(batch)
        finally:
            runner.remove_requests(batch.scheduled_rnums)
            runner.bind_kv_cache(saved)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture the decode CUDA graphs over it (on CUDA)."""
        with self.log.phase(f"KV cache of {num_blocks} blocks allocated"):
            self.runner.init_kv_cache(num_blocks)
        if self.device.type == "cuda":
            with self.log.phase("CUDA graphs captured"):
                line = self.runner.capture_cuda_graphs(margin=self.graph_margin)
            if self.rank == 0:
                print(f"trillm: {line}", file=sys.stderr, flush=True)
        self.log.total()

    def execute(
        self, batch: StepBatch, masks: Callable[[], np.ndarray] | None = None
    ) -> RunnerOutput:
        return self.runner.execute(batch, masks)

    def execute_ahead(
        self, batch: StepBatch, masks: Callable[[], np.ndarray] | None = None
    ) -> PendingOutput:
        """`execute`, its output read later (async scheduling, `ModelRunner.execute_ahead`)."""
        return self.runner.execute_ahead(batch, masks)

    def add_lora(self, module: LoraModule) -> str:
        """Read and check adapter `module` for this rank; return its digest.

        Raises:
            LoraAdapterError: it cannot be served; the message says why.
        """
        return self.runner.add_lora(module)

    def remove_lora(self, lora_id: int) -> None:
        """Forget adapter `lora_id` for new requests; running ones keep it."""
        self.runner.remove_lora(lora_id)

    def sleep(self, level: int) -> None:
        """Free the KV cache (and its CUDA graphs); level 2 also moves the weights to host
        memory (on CPU they are there already, so level 2 is level 1). Remembers the cache's
        size for `wake_up`."""
        runner = self.runner
        if not runner.kv_caches:
            raise RuntimeError("sleep() without a KV cache (asleep already, or not started)")
        self._asleep_blocks = runner.free_kv_cache()
        if level >= 2 and self.device.type == "cuda" and runner.model is not None:
            runner.model.to("cpu")
            self._weights_offloaded = True
        release_memory(self.device)

    def wake_up(self) -> None:
        """The weights back on the device, a zeroed KV cache of the old size, the graphs
        captured again (on CUDA: they point at the old cache)."""
        if self._asleep_blocks is None:
            raise RuntimeError("wake_up() without sleep()")
        model = self.runner.model
        if self._weights_offloaded and model is not None:
            model.to(self.device)
            self._weights_offloaded = False
        blocks, self._asleep_blocks = self._asleep_blocks, None
        self.init_kv_cache(blocks)

    def shutdown(self) -> None:
        """Leave the process group (idempotent)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _profile_batch(num_seqs: int, seq_len: int, blocks_per_seq: int) -> StepBatch:
    """A first step of `num_seqs` prompts of `seq_len` tokens, under request numbers no
    engine hands out (from 2**63)."""
    requests = [
        NewRequest(
            rnum=2**63 + i,
            prompt_token_ids=[0] * seq_len,
            block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            num_computed_tokens=0,
        )
        for i in range(num_seqs)
    ]
    return StepBatch(
        0,
        new_requests=requests,
        scheduled_rnums=np.array([r.rnum for r in requests], np.uint64),
        num_scheduled_tokens=np.full(num_seqs, seq_len, np.int32),
    )


# glibc's mallopt parameters (malloc.h) and the values the CPU engine runs with.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # above a 2048-token step's [T, hidden] and [T, q + 2 kv]
TRIM_THRESHOLD = 1 << 30


def keep_activations_in_heap() -> bool:
    """Serve blocks up to 32 MiB from glibc's heap and keep up to 1 GiB of freed heap, so a
    step's activations reuse the last step's pages; False where libc is not glibc.

    Why: by default glibc maps each large block (from 128 KiB, rising with what is freed) anew
    and unmaps it on free, and trims the heap's top past twice that, so every prefill step
    page-faulted and zeroed its activations again: 174,582 minor faults a 2048-token step of
    SmolLM2 float32, 7 with these thresholds (`perf/prefill_ab.py`, `perf/README.md`).
    `release_memory` still trims the heap (sleep).
    """
    libc = ctypes.CDLL(None)  # the process's own symbols: the libc it runs on
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # musl and others: their malloc has no such knobs
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def release_memory(device: torch.device) -> None:
    """Give freed tensor memory back: CUDA's caching allocator to the driver; on CPU,
    glibc's free pages to the kernel (`malloc_trim`: freed chunks below the mmap threshold
    stay in the heap, counted in RSS, until trimmed)."""
    gc.collect()  # a cycle may still hold a tensor
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    name = ctypes.util.find_library("c")
    if name is not None:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):  # glibc only
            libc.malloc_trim(0)
