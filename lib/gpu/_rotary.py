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


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given positions, from a cos/sin table."""

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
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by the angles of `positions` [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
