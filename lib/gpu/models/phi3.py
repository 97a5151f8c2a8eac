"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's decoder with fused checkpoint tensors, longrope and
partial rotary.

The checkpoint's `qkv_proj` and `gate_up_proj` already hold the merged projections
(`ColumnParallelLinear.load_fused` splits them into each rank's parts); longrope's short and
long factors and its attention factor are `_rotary`'s; Phi-4-mini rotates only
`partial_rotary_factor` of each head; a `sliding_window` applies to every layer.
"""

from __future__ import annotations

from typing import Any

from ._model_config import rope_parameters, sliding_windows
from .llama import LlamaForCausalLM


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    rope = rope_parameters(raw)
    factor = float(raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    head_dim = int(
        raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"])
    )
    scaling = raw.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    fields: dict[str, Any] = dict(
        rotary_dim=int(head_dim * factor), layer_windows=sliding_windows(raw)
    )
    if kind == "longrope":
        original = scaling.get("original_max_position_embeddings") or raw.get(
            "original_max_position_embeddings"
        )
        if original is None:
            raise ValueError("longrope needs original_max_position_embeddings")
        fields["rope_scaling"] = dict(
            scaling, rope_type="longrope", original_max_position_embeddings=int(original)
        )
    return fields


MODEL = LlamaForCausalLM
