"""OLMo 2: norms after attention and after the MLP (none before), and an RMSNorm over the
whole q and k projections (not per head) before rotary.

Under tensor parallelism each rank holds a slice of q and k, so their norms all-reduce the
sum of squares (`RMSNorm(tp=...)`).
"""

from __future__ import annotations

from typing import Any

import torch

from .._model_config import ModelConfig
from .._parallel import TensorParallel
from .._rotary import Rope, RotaryEmbedding
from .llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM, Meta


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm="projection")


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """x + norm(attn(x)), then x + norm(mlp(x)); no norm before either block."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding | None,
        tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(config, layer, rotary, tp, dtype)
        del self.input_layernorm  # the checkpoint has none
        self.post_feedforward_layernorm = self.make_norm(config, dtype)

    def forward(
        self, rope: Rope | None, hidden: torch.Tensor, kv: KVCache, meta: Meta
    ) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, hidden, kv, meta))
        result: torch.Tensor = hidden + self.post_feedforward_layernorm(self.mlp(hidden))
        return result


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer


MODEL = Olmo2ForCausalLM
