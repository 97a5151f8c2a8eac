"""CUDA graphs of the model's forward for decode steps, one per captured batch size.

A decode step of a 1B model reads its weights in about half a millisecond on an H200, while
launching its few hundred kernels from Python takes several: replaying a captured graph
launches them all at once. Graphs are captured for the batch sizes of
`WorkerConfig.cuda_graph_sizes()` (1, 2, 4, 8, then every 8), largest first so every graph
shares one memory pool, over static input buffers: token ids, positions, slot mapping (-1 for
padding rows, which the KV write skips), sequence lengths (0 for padding rows, which attend to
nothing) and a block table as wide as `max_model_len` needs. A step of B decodes is padded to
the next captured size; its logits are computed outside the graph, from the first B rows.

The inputs reach the static buffers in one host-to-device copy a step from a pinned mirror,
padded on the host (`_graph_inputs`). Only the forward is captured: what depends on the step
(building inputs, sampling, penalties, grammar masks) runs eager around it, as in vLLM.
Prefill and mixed steps run eager too.

Off CUDA, `capture` records no graph and `run` runs the forward eagerly over the same static,
padded buffers, so the padding and the static metadata are tested on any machine.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..attention._attention_triton import TritonAttention, TritonAttentionMetadata
from ..models.llama import KVCache, LlamaForCausalLM
from ._graph_inputs import GraphInputs


@dataclass(frozen=True)
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    bytes: int  # device memory the graphs' pool took

    def describe(self) -> str:
        sizes = (
            ", ".join(map(str, self.sizes))
            if len(self.sizes) <= 6
            else (f"{self.sizes[0]}, {self.sizes[1]}, ..., {self.sizes[-1]}")
        )
        return (
            f"cuda graphs: {len(self.sizes)} decode batch sizes ({sizes}) captured in "
            f"{self.seconds:.2f} s, {self.bytes / 2**20:.0f} MiB"
        )


class DecodeGraphs:
    """The captured graphs and their static inputs; `run` replays the one for a batch."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        attention: TritonAttention,
        sizes: tuple[int, ...],
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.sizes = tuple(sorted(sizes))
        self.max_size = self.sizes[-1]
        n = self.max_size
        self.inputs = GraphInputs(n, max_blocks, device)  # ids, positions, slots, lengths
        self.input_ids, self.positions = self.inputs.input_ids, self.inputs.positions
        self.slots, self.seq_lens = self.inputs.slots, self.inputs.seq_lens
        self.block_tables = self.inputs.block_tables
        with torch.device(device):
            self.query_start = torch.arange(n + 1, dtype=torch.int32)  # one token a sequence
            self.qblock_seq = torch.arange(n, dtype=torch.int32)
            self.qblock_first = torch.zeros(n, dtype=torch.int32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.num_runs = 0  # decode steps run through the static buffers

    def _metadata(self, size: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=self.slots[:size],
            seq_lens=self.seq_lens[:size],
            query_start=self.query_start[: size + 1],
            block_tables=self.block_tables[:size],
            qblock_seq=self.qblock_seq[:size],
            qblock_first=self.qblock_first[:size],
            num_segments=self.attention.segments_for(size, 1),
            backend=self.attention,
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden: torch.Tensor = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size)
        )
        return hidden

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Warm up (compile the kernels) and capture every size; padding rows touch nothing."""
        device = self.input_ids.device
        if device.type != "cuda":
            self.graphs = dict.fromkeys(self.sizes)
            return CaptureReport(self.sizes, 0.0, 0)
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # Triton compiles its specialisation for this size here
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        return CaptureReport(self.sizes, time.perf_counter() - start, max(0, used))

    def size_for(self, num_seqs: int) -> int | None:
        """The captured size a batch of `num_seqs` decodes pads to; None: too large."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        *,
        ids_patch: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of B decode tokens (host arrays: they reach the static
        buffers padded, in one copy, `GraphInputs.fill`). `ids_patch` then sets some of the
        static ids on the device, in the same stream (async scheduling's tokens in flight)."""
        b = len(input_ids)
        size = self.size_for(b)
        if size is None:
            raise ValueError(f"no CUDA graph for {b} sequences (largest: {self.max_size})")
        self.inputs.fill(size, input_ids, positions, slots, seq_lens, block_tables)
        if ids_patch is not None:
            ids_patch(self.inputs.input_ids)
        captured = self.graphs[size]
        self.num_runs += 1
        if captured is None:  # off CUDA: the same buffers, eagerly
            return self._forward(size)[:b]
        graph, out = captured
        graph.replay()
        return out[:b]
