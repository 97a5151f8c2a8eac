"""Tensor parallelism: which shard this rank holds, and the two collectives it needs.

Passed explicitly to every layer (no global process-group context): a model built with
`TensorParallel()` is the plain single-device model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(ValueError):
    """A model dimension cannot be split evenly over the tensor-parallel ranks."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None is the default group

    def split(self, size: int, what: str) -> int:
        """`size` / world_size, refusing uneven splits.

        Raises:
            TensorParallelError: `size` is not a multiple of the world size.
        """
        if size % self.world_size:
            raise TensorParallelError(
                f"{what} ({size}) is not divisible by tensor_parallel_size {self.world_size}; "
                f"choose a tensor-parallel size that divides it"
            )
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
