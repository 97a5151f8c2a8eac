"""Rotary position embedding (Hugging Face's rotate-half layout), with llama3/linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """The per-pair rotation frequencies, scaled as the model's config says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


Rope = tuple[torch.Tensor, torch.Tensor]  # cos and signed sin, each [T, 1, head_dim]


class RotaryEmbedding(nn.Module):
    """RoPE from a cos/sin table, in rotate-half form: x * cos + swap_halves(x) * sin.

    The table holds cos twice and (-sin, sin), so one rotation is a roll, a multiply and a
    fused multiply-add over whole heads; `angles` is gathered once per forward and every layer
    rotates its query and key heads together (they are adjacent in the qkv projection).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1).to(dtype), persistent=False)

    def angles(self, positions: torch.Tensor) -> Rope:
        """The rotation of each token at `positions` [T], shared by every layer of a forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Rotate heads x [T, heads, D] (any strides) by `rope`; returns a new tensor."""
        cos, sin = rope
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
