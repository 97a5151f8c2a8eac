"""Mixture-of-experts decoders: Qwen3-MoE (Qwen3-30B-A3B) and Mixtral.

Both are their dense family's decoder (Qwen3 with q/k norms; Mistral) with `_moe.FusedMoE`
in place of the MLP on MoE layers. Qwen3-MoE renormalises the top-k weights when
`norm_topk_prob` says so and keeps dense MLPs on `mlp_only_layers` and off the
`decoder_sparse_step`; Mixtral always renormalises, and its checkpoint names
(`block_sparse_moe`, `w1`/`w3`/`w2`) are read as Qwen's (`mlp`, gate/up/down).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..layers._moe import FusedMoE
from ..layers._parallel import TensorParallel
from ._model_config import ModelConfig, sliding_windows
from .llama import LlamaDecoderLayer, LlamaForCausalLM


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if experts <= 0:
        raise ValueError("a mixture-of-experts config needs num_experts (or num_local_experts)")
    if raw["model_type"] == "mixtral":
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
            layer_windows=sliding_windows(raw),
        )
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or ())
    bias = bool(raw.get("attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        num_experts=experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        layer_windows=sliding_windows(raw, flagged=True),
    )


class MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(
        self, config: ModelConfig, layer: int, tp: TensorParallel, dtype: torch.dtype
    ) -> nn.Module:
        if not config.is_moe_layer(layer):
            return super().make_mlp(config, layer, tp, dtype)
        return FusedMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
            act=config.hidden_act,
            tp=tp,
            dtype=dtype,
        )


_MIXTRAL = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.w1\.(weight|bias)$"), r".gate_proj.\1"),
    (re.compile(r"\.w3\.(weight|bias)$"), r".up_proj.\1"),
    (re.compile(r"\.w2\.(weight|bias)$"), r".down_proj.\1"),
)


class MoeForCausalLM(LlamaForCausalLM):
    layer_class = MoeDecoderLayer

    def checkpoint_name(self, name: str) -> str:
        if self.config.model_type != "mixtral" or ".block_sparse_moe." not in name:
            return name
        for pattern, replacement in _MIXTRAL:
            name = pattern.sub(replacement, name)
        return name


MODEL = MoeForCausalLM
