"""Tiny seeded random models of every family trillm runs, built by transformers at test time.

Each is small (hidden 64, 2-4 layers) with SmolLM2's tokenizer, so the server can serve it
too, and exercises what its family adds: windows shorter than the test prompts, soft-caps that
bite, multipliers other than 1, layers without rotary, partial rotary with longrope, experts
with both routings. `initializer_range` 0.2 makes the logits peaked enough that greedy ties
cannot flip a token between two correct implementations.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from trillm.default_model import default_model_dir

BASE: dict[str, Any] = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# family -> (config class, model class, the config fields that exercise what it adds)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=6,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=3.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            sliding_window=10,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + i / 6 for i in range(6)],
                "long_factor": [2.0 + i for i in range(6)],
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            embedding_multiplier=3.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        ),
    ),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(num_hidden_layers=4, no_rope_layer_interval=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=12),
    ),
}
DENSE = ["qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3"]
MOE = ["qwen3_moe", "mixtral"]


def build(family: str, **overrides: Any) -> transformers.PreTrainedModel:
    """The seeded random model of `family`, in float32 and eval mode."""
    config_name, model_name, fields = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**BASE, **fields, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    if family == "gemma2":  # eager: transformers' SDPA path has no soft-cap
        model.config._attn_implementation = "eager"
    return model


def save(family: str, path: Path, **overrides: Any) -> Path:
    """`build(family)` saved with SmolLM2's tokenizer files."""
    build(family, **overrides).save_pretrained(path)
    tokenizer_dir = default_model_dir(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def greedy(model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens
