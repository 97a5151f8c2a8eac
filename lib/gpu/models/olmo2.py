"""OLMo 2: norms after attention and after the MLP (none before), and an RMSNorm over the
whole q and k projections (not per head) before rotary.

Under tensor parallelism each rank holds a slice of q and k, so their norms all-reduce the
sum of squares (`RMSNorm(tp=...)`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers._layers import RMSNorm
from ..layers._rotary import Rope
from .llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM, Meta


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm="projection")


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """x + norm(attn(x)), then x + norm(mlp(x)); no norm before either block."""

    post_feedforward_layernorm: RMSNorm
    norm_names = (
        "post_attention_layernorm",
        "post_feedforward_layernorm",
    )  # no norm before either block

    def forward(
        self, rope: Rope | None, hidden: torch.Tensor, kv: KVCache, meta: Meta
    ) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, hidden, kv, meta))
        result: torch.Tensor = hidden + self.post_feedforward_layernorm(self.mlp(hidden))
        return result


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer


MODEL = Olmo2ForCausalLM
