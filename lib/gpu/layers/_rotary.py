"""Rotary position embedding (Hugging Face's rotate-half layout), with llama3 / linear /
longrope scaling and partial rotary (the first `rotary_dim` dims of each head)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, *, long: bool = False
) -> torch.Tensor:
    """The per-pair rotation frequencies of `head_dim` rotated dims, scaled as the config
    says (`long`: longrope's factors for positions past the original context)."""
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
    if kind == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"longrope has {len(factors)} factors for {head_dim // 2} rotated pairs"
            )
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    raise ValueError(
        f"rope scaling {kind!r} is not supported (supported: default, linear, llama3, longrope)"
    )


def attention_factor(scaling: dict[str, Any] | None, max_positions: int) -> float:
    """The factor cos and sin are scaled by (longrope's sqrt(1 + ln s / ln L0); else 1)."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


Rope = tuple[torch.Tensor, torch.Tensor]  # cos and signed sin, each [T, 1, rotary_dim]


class RotaryEmbedding(nn.Module):
    """RoPE from a cos/sin table, in rotate-half form: x * cos + swap_halves(x) * sin.

    The table holds cos twice and (-sin, sin), so one rotation is a roll, a multiply and a
    fused multiply-add over whole heads; `angles` is gathered once per forward and every layer
    rotates its query and key heads together (they are adjacent in the qkv projection).
    Longrope's table is two: the short factors' rows, then (from `long_offset` on) the long
    ones'. transformers takes the long factors for a whole forward once its longest position
    passes the original context; per sequence that is "once its context does", so the runner
    shifts the positions of a sequence whose context passes `original_context` by
    `long_offset` (`rope_positions`).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.long_offset = 0  # longrope: where the long factors' rows start
        self.original_context = 0
        inv_freq = inverse_frequencies(rotary_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        if scaling is not None and scaling["rope_type"] == "longrope":
            self.long_offset = max_positions
            self.original_context = int(scaling["original_max_position_embeddings"])
            long = inverse_frequencies(rotary_dim, theta, scaling, long=True)
            angles = torch.cat((angles, torch.outer(positions, long)))
        mscale = attention_factor(scaling, max_positions)
        cos, sin = angles.cos() * mscale, angles.sin() * mscale
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1).to(dtype), persistent=False)

    def angles(self, positions: torch.Tensor) -> Rope:
        """The rotation of each token at `positions` [T], shared by every layer of a forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rope_positions(
        self, positions: np.ndarray, counts: np.ndarray, context_lens: np.ndarray
    ) -> np.ndarray:
        """The table rows of a step's tokens: `positions`, shifted to the long factors' rows
        for the sequences (`counts` tokens each) whose context passes the original one."""
        if not self.long_offset:
            return positions
        long = np.repeat(context_lens > self.original_context, counts)
        shifted: np.ndarray = positions + long * self.long_offset
        return shifted

    def rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Rotate heads x [T, heads, D] (any strides) by `rope`; returns a new tensor."""
        cos, sin = rope
        if self.rotary_dim == x.shape[-1]:
            return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
        part = x[..., : self.rotary_dim]
        rotated = torch.addcmul(part * cos, part.roll(self.rotary_dim // 2, -1), sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), -1)
