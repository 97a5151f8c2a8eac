"""Tensor-parallel building blocks of a Llama-family decoder.

Column-parallel layers split their output features over the ranks (no communication);
row-parallel layers split their input features and all-reduce the partial sums. Each layer
knows how to take its shard out of a full Hugging Face weight (`load`), so a checkpoint is
read once, whatever the tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._cpu_linear import pack_weight, packed_linear
from ._parallel import TensorParallel


def _drop(param: nn.Parameter) -> None:
    """Free a dense weight that now lives packed (its shape is kept in the packed tensor)."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as Hugging Face's Llama does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
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

    def load(self, part: int, weight: torch.Tensor, *, is_bias: bool = False) -> None:
        """Copy this rank's rows of the full `weight` of merged part `part`."""
        shard = self.shard_sizes[part]
        start = sum(self.shard_sizes[:part])
        rows = weight.narrow(0, self.tp.rank * shard, shard)
        target = self.bias if is_bias else self.weight
        if target is None:
            raise KeyError("this layer has no bias, but the checkpoint has one")
        target.data[start : start + shard].copy_(rows)

    def pack(self) -> None:
        """Move the loaded weight into oneDNN's layout (CPU only; see `_cpu_linear`)."""
        self.packed = pack_weight(self.weight)
        _drop(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


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

    def load(self, weight: torch.Tensor, *, is_bias: bool = False) -> None:
        """Copy this rank's columns of the full `weight` (the bias is not split)."""
        if is_bias:
            if self.bias is None:
                raise KeyError("this layer has no bias, but the checkpoint has one")
            self.bias.data.copy_(weight)
            return
        self.weight.data.copy_(weight.narrow(1, self.tp.rank * self.shard, self.shard))

    def pack(self) -> None:
        """Move the loaded weight into oneDNN's layout (CPU only; see `_cpu_linear`)."""
        self.packed = pack_weight(self.weight)
        _drop(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = (
            F.linear(x, self.weight) if self.packed is None else packed_linear(x, self.packed, None)
        )
        out = self.tp.all_reduce(partial)
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

    def load(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full [vocab, hidden] matrix."""
        rows = weight[self.start : self.start + self.shard]
        self.weight.data[: len(rows)].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def pack(self) -> None:
        """A packed copy of the matrix for `logits`; the dense one stays for the lookup.

        That costs one more vocab x hidden matrix of memory (113 MB for SmolLM2 in float32),
        and halves the head's time per decode step on AVX-512 CPUs.
        """
        self.packed_head = pack_weight(self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits, gathered from every rank's vocab shard."""
        if self.packed_head is not None:
            local = packed_linear(hidden, self.packed_head, None)
        else:
            local = F.linear(hidden, self.weight)
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]
