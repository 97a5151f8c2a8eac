"""Gemma 2 and Gemma 3 (text): a sandwich of norms around each block, GeGLU, soft-caps and
alternating sliding-window layers.

What transformers' Gemma 2 / Gemma 3 do, each here: the embedding scaled by sqrt(hidden);
every RMSNorm scales by (1 + weight), in float32; GeGLU with tanh-approximated GELU; a norm
after attention and around the MLP (`pre_` / `post_feedforward_layernorm`); scores scaled by
`query_pre_attn_scalar` ** -0.5; Gemma 2's attention-logit soft-cap (transformers' Gemma 3
passes none to its attention, so none is applied here either) and final-logit soft-cap;
`layer_types` alternating sliding and full layers, and Gemma 3's own rope base for the
sliding ones plus q/k norms per head.

Sliding layers keep every block of their sequence in the paged cache, as full layers do: the
blocks are shared by all layers of a sequence, so a block before a sliding layer's window is
still read by the full layers. `docs/design.md` ("Sliding windows") says what that costs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layers._layers import RMSNorm
from ..layers._rotary import Rope
from ._model_config import rope_parameters, sliding_windows
from .llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM, Meta


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    gemma3 = raw["model_type"] == "gemma3_text"
    raw = dict(raw)
    if raw.get("layer_types") is None:  # configs from before transformers wrote them
        pattern = int(raw.get("sliding_window_pattern") or (6 if gemma3 else 2))
        raw["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(int(raw["num_hidden_layers"]))
        ]
    local = rope_parameters(raw, "sliding_attention")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        hidden_act=_activation(raw.get("hidden_activation") or raw.get("hidden_act")),
        norm_offset=1.0,
        qk_norm="head" if gemma3 else "",
        attention_scale=float(raw.get("query_pre_attn_scalar") or raw["head_dim"]) ** -0.5,
        attn_logit_softcap=0.0 if gemma3 else float(raw.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        embedding_multiplier=math.sqrt(int(raw["hidden_size"])),
        layer_windows=sliding_windows(raw),
        local_rope_theta=float(raw.get("rope_local_base_freq") or local.get("rope_theta", 1e4))
        if gemma3
        else None,
    )


def _activation(name: object) -> str:
    if name in ("gelu_pytorch_tanh", "gelu_tanh", None):
        return "gelu_tanh"
    raise ValueError(f"hidden_activation {name!r} is not supported (gelu_pytorch_tanh)")


class GemmaDecoderLayer(LlamaDecoderLayer):
    """x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm
    norm_names = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def forward(
        self, rope: Rope | None, hidden: torch.Tensor, kv: KVCache, meta: Meta
    ) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        result: torch.Tensor = hidden + self.post_feedforward_layernorm(mlp)
        return result


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer


MODEL = GemmaForCausalLM
