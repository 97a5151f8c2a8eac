"""Qwen3 (0.6B-32B): Llama's decoder with an RMSNorm on each query and key head before rotary.

The q/k norms (`self_attn.q_norm`, `self_attn.k_norm`, one weight of head_dim each) are what
`LlamaAttention` does for `qk_norm="head"`; the rest is Llama's, with Qwen's optional
`attention_bias` on q, k, v and o alike and sliding windows from `layer_types`.
"""

from __future__ import annotations

from typing import Any

from ._model_config import sliding_windows
from .llama import LlamaForCausalLM


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return dict(
        qkv_bias=bias, o_bias=bias, qk_norm="head", layer_windows=sliding_windows(raw, flagged=True)
    )


MODEL = LlamaForCausalLM
