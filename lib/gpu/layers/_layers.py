"""Tensor-parallel building blocks of a Llama-family decoder.

Column-parallel layers split their output features over the ranks (no communication);
row-parallel layers split their input features and all-reduce the partial sums. Each layer
knows how to take its shard out of a full Hugging Face weight (`load`), so a checkpoint is
read once, whatever the tensor-parallel size. A GGUF weight kept in its blocks
(`QuantizedTensor`) is sharded the same way, block rows or block-aligned columns, and packed for
its kernel (int4 or float16) by `finish_quantized` once every part has arrived (`_quantized`).
With LoRA on, a linear's `lora` (`_lora_slots.LoraLinear`) adds the step's adapter deltas
after the base product (a row-parallel one before its all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu._cpu_linear import pack_weight, packed_linear
from ..cpu._cpu_ops import cpu_norms
from ..lora._lora_slots import LoraLinear
from ..quant._gguf_blocks import QuantizedTensor
from ..quant._quantized import QuantizedLinearWeight, pack_quantized
from ._parallel import TensorParallel

if TYPE_CHECKING:
    from ._fused_kernels import FusedOps


def _drop(param: nn.Parameter) -> None:
    """Free a dense weight that now lives packed (its shape is kept in the packed tensor)."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _linear(
    x: torch.Tensor,
    quantized: QuantizedLinearWeight | None,
    packed: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` through whichever form the weight is kept in."""
    if quantized is not None:
        out = quantized(x)
        return out if bias is None else out + bias
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class NormOps(Protocol):
    """RMSNorm with the residual add before it fused in: CUDA's Triton kernels
    (`_fused_kernels.FusedOps`) or the CPU's C ones (`_cpu_ops.CpuNorms`). Each rounds as
    `RMSNorm.forward` and the torch add do (offset: Gemma's (1 + w))."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
    ) -> torch.Tensor: ...

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as Hugging Face's Llama does.

    `offset`: the scale is (offset + weight), Gemma's (1 + w), multiplied in float32 before
    the cast back as Gemma does. `tp`: the normed vector is split over the ranks (OLMo 2's
    q/k norm over the whole projection): the sum of squares is all-reduced, and the weight is
    this rank's slice (`load`).
    """

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype,
        *,
        offset: float = 0.0,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.full_size = size
        local = size if self.tp is None else self.tp.split(size, "normed features")
        init = 0.0 if offset else 1.0
        self.weight = nn.Parameter(torch.full((local,), init, dtype=dtype), requires_grad=False)
        self.fused: FusedOps | None = None  # CUDA: one Triton kernel (`use_fused`)

    def load(self, weight: torch.Tensor) -> None:
        """Copy this rank's part of the full weight."""
        if self.tp is not None:
            shard = self.weight.shape[0]
            weight = weight.narrow(0, self.tp.rank * shard, shard)
        self.weight.data.copy_(weight)

    def scale(self) -> torch.Tensor:
        """The float32 scale the normed vector is multiplied by (offset + weight)."""
        return self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            x32 = x.float()
            squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
            normed = x32 * torch.rsqrt(squares / self.full_size + self.eps)
            return (normed * self.scale()).to(x.dtype)
        if self.fused is not None:  # the same rounding order, in one launch
            return self.fused.rms_norm(x, self.weight, self.eps, self.offset)
        norms = cpu_norms(x) if x.is_contiguous() else None  # not per-head q/k views
        if norms is not None:  # one C pass on the CPU (float32, bfloat16), the same rounding
            return norms.rms_norm(x, self.weight, self.eps, self.offset)
        if x.dtype == torch.float32:  # one fused kernel, the same arithmetic
            weight = self.weight if not self.offset else self.weight + self.offset
            return F.rms_norm(x, self.weight.shape, weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * self.scale()).to(dtype)
        return self.weight * x32.to(dtype)


class ColumnParallelLinear(nn.Module):
    """Linear layer whose (possibly merged) outputs are split over the ranks.

    `part_sizes` are the full output sizes of the merged parts (q, k, v or gate, up); each
    part is sharded separately, so the local weight is [q_shard; k_shard; v_shard].
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        *,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        what: str,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.shard_sizes = [tp.split(size, f"{what} part {i}") for i, size in enumerate(part_sizes)]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedLinearWeight | None = None
        self._quantized_parts: dict[int, QuantizedTensor] = {}
        self.lora: LoraLinear | None = None  # `--enable-lora`: the adapters' slots
        # Kept quantized in C tiles (`_tiles`), gate/up goes tile by tile, as the C decode
        # step fuses SiLU(gate) * up; the forward still sees [gate | up].
        self.interleaved = (
            interleaved
            and len(set(self.shard_sizes)) == 1 == len(part_sizes) - 1
            and self.shard_sizes[0] % 16 == 0
        )

    def load(
        self, part: int, weight: torch.Tensor | QuantizedTensor, *, is_bias: bool = False
    ) -> None:
        """Copy (or, quantized, keep) this rank's rows of the full `weight` of part `part`."""
        shard = self.shard_sizes[part]
        if isinstance(weight, QuantizedTensor):
            self._quantized_parts[part] = weight.rows(self.tp.rank * shard, shard)
            return
        start = sum(self.shard_sizes[:part])
        rows = weight.narrow(0, self.tp.rank * shard, shard)
        target = self.bias if is_bias else self.weight
        if target is None:
            raise KeyError("this layer has no bias, but the checkpoint has one")
        target.data[start : start + shard].copy_(rows)

    def load_fused(self, weight: torch.Tensor | QuantizedTensor, *, is_bias: bool = False) -> None:
        """Load a checkpoint tensor that holds every part, stacked (Phi-3's `qkv_proj`)."""
        full = [size * self.tp.world_size for size in self.shard_sizes]
        if weight.shape[0] != sum(full):
            raise KeyError(f"a fused tensor of {weight.shape[0]} rows, not {sum(full)}")
        start = 0
        for part, size in enumerate(full):
            rows = (
                weight.rows(start, size)
                if isinstance(weight, QuantizedTensor)
                else weight.narrow(0, start, size)
            )
            self.load(part, rows, is_bias=is_bias)
            start += size

    def finish_quantized(self) -> None:
        """Pack the kept parts for their kernel; if only some parts came quantized (a file
        that mixes types), dequantise them into the dense weight instead."""
        parts, self._quantized_parts = self._quantized_parts, {}
        if len(parts) == len(self.shard_sizes):
            ordered = [parts[i] for i in sorted(parts)]
            self.quantized = pack_quantized(ordered, interleaved=self.interleaved)
            _drop(self.weight)
            return
        for part, rows in parts.items():
            start = sum(self.shard_sizes[:part])
            self.weight.data[start : start + rows.shape[0]].copy_(rows.dequantize())

    def pack(self) -> None:
        """Move the loaded weight into oneDNN's layout (CPU only; see `_cpu_linear`)."""
        if self.quantized is None:
            self.packed = pack_weight(self.weight)
            _drop(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _linear(x, self.quantized, self.packed, self.weight, self.bias)
        return out if self.lora is None else self.lora.add_delta(x, out)


class RowParallelLinear(nn.Module):
    """Linear layer whose inputs are split over the ranks; partial sums are all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        what: str,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.shard = tp.split(in_features, what)
        self.weight = nn.Parameter(
            torch.empty(out_features, self.shard, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedLinearWeight | None = None
        self._quantized_columns: QuantizedTensor | None = None
        self.lora: LoraLinear | None = None  # `--enable-lora`: the adapters' slots

    def load(self, weight: torch.Tensor | QuantizedTensor, *, is_bias: bool = False) -> None:
        """Copy (or, quantized, keep) this rank's columns of the full `weight` (the bias is
        not split)."""
        if isinstance(weight, QuantizedTensor):
            self._quantized_columns = weight.cols(self.tp.rank * self.shard, self.shard)
            return
        if is_bias:
            if self.bias is None:
                raise KeyError("this layer has no bias, but the checkpoint has one")
            self.bias.data.copy_(weight)
            return
        self.weight.data.copy_(weight.narrow(1, self.tp.rank * self.shard, self.shard))

    def finish_quantized(self) -> None:
        """Pack the kept columns for their kernel (int4 or float16)."""
        if self._quantized_columns is not None:
            self.quantized = pack_quantized([self._quantized_columns])
            self._quantized_columns = None
            _drop(self.weight)

    def pack(self) -> None:
        """Move the loaded weight into oneDNN's layout (CPU only; see `_cpu_linear`)."""
        if self.quantized is None:
            self.packed = pack_weight(self.weight)
            _drop(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = _linear(x, self.quantized, self.packed, self.weight)
        if self.lora is not None:  # partial deltas (A split like x), summed with the base's
            local = self.lora.add_delta(x, local)
        out = self.tp.all_reduce(local)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the ranks (padded to divide evenly).

    Also serves as the LM head (`logits`), tied or not: the head is the same vocab-sharded
    matrix, and its partial logits are all-gathered.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, *, tp: TensorParallel, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(
            torch.zeros(self.shard, hidden_size, dtype=dtype), requires_grad=False
        )
        self.packed_head: torch.Tensor | None = None
        # Quantized: the blocks for the lookup (dequantised per looked-up row) and the head
        # packed for its kernel (float16 for Q8_0), in place of the dense matrix and its copy.
        self.quantized_table: QuantizedTensor | None = None
        self.quantized_head: QuantizedLinearWeight | None = None

    def load(self, weight: torch.Tensor | QuantizedTensor) -> None:
        """Copy (or, quantized, keep) this rank's rows of the full [vocab, hidden] matrix."""
        rows = min(self.shard, self.vocab_size - self.start)
        if isinstance(weight, QuantizedTensor):
            self.quantized_table = weight.rows(self.start, rows)
            return
        self.weight.data[:rows].copy_(weight[self.start : self.start + rows])

    def finish_quantized(self, *, lookup: bool, head: bool) -> None:
        """Pack the kept matrix as the head (`head`); keep its blocks only for `lookup`."""
        table = self.quantized_table
        if table is None:
            return
        if head:
            self.quantized_head = pack_quantized([table], rows=self.shard)
        if not lookup:
            self.quantized_table = None
        _drop(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_table is None:
            return F.embedding(local_ids, self.weight)
        return self.quantized_table.gather_rows(local_ids).to(self.weight.dtype)

    def pack(self) -> None:
        """A packed copy of the matrix for `logits`; the dense one stays for the lookup.

        That costs one more vocab x hidden matrix of memory (113 MB for SmolLM2 in float32),
        and halves the head's time per decode step on AVX-512 CPUs.
        """
        if self.quantized_head is None:
            self.packed_head = pack_weight(self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits, gathered from every rank's vocab shard."""
        local = _linear(hidden, self.quantized_head, self.packed_head, self.weight)
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]
