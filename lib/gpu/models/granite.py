"""IBM Granite 3: Llama's decoder with four multipliers.

The embedding is scaled by `embedding_multiplier`, attention scores by `attention_multiplier`
(in place of head_dim ** -0.5), each block's output by `residual_multiplier` before it joins
the residual stream, and the logits divided by `logits_scaling`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers._rotary import Rope
from .llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM, Meta


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        attention_scale=float(raw.get("attention_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
    )


class GraniteDecoderLayer(LlamaDecoderLayer):
    def forward(
        self, rope: Rope | None, hidden: torch.Tensor, kv: KVCache, meta: Meta
    ) -> torch.Tensor:
        m = self.residual_multiplier
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv, meta) * m
        result: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden)) * m
        return result


class GraniteForCausalLM(LlamaForCausalLM):
    layer_class = GraniteDecoderLayer


MODEL = GraniteForCausalLM
