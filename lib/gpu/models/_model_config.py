"""A decoder's shape and architecture knobs, read once from its Hugging Face ``config.json``.

The common fields are read here; each family's module (`models/`, found through the registry)
reads the rest with its `parse_config`. The knobs are named by what they do (`qk_norm`,
`layer_windows`, `final_logit_softcap`, ...), so the shared code (attention, the C step, the
runner) asks about an operation, never about a family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import family_for, supported_model_types


class ModelConfigError(ValueError):
    """The model's configuration is missing, malformed, or describes an unsupported model."""


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's hyper-parameters; the defaults are Llama's."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2; Llama's `attention_bias` (which also biases o_proj)
    o_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gate's activation: silu, or gelu_tanh (GeGLU)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): 1.0 for Gemma
    qk_norm: str = ""  # RMSNorm of q and k before rotary: "head" (per head), "projection"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float = 0.0  # cap * tanh(score / cap); 0: none
    final_logit_softcap: float = 0.0
    embedding_multiplier: float = 1.0  # the embedding is scaled by this
    residual_multiplier: float = 1.0  # each block's output is, before the residual add
    logits_scaling: float = 1.0  # the logits are divided by this
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 full; () all full
    layer_rope: tuple[bool, ...] = ()  # per layer: rotary applied; () all
    local_rope_theta: float | None = None  # the rope base of sliding layers (Gemma 3)
    rotary_dim: int = 0  # dims of each head rotated (partial rotary); 0: head_dim
    num_experts: int = 0  # mixture of experts: experts per MoE layer; 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (else a dense MLP); () all MoE
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict.

        Raises:
            ModelConfigError: an unsupported `model_type` or a missing or malformed field.
        """
        model_type = config.get("model_type")
        family = family_for(model_type)
        if family is None:
            raise ModelConfigError(
                f"{source}: model_type {model_type!r} is not supported; trillm runs "
                f"{', '.join(supported_model_types())}"
            )
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            rope = rope_parameters(config)
            common: dict[str, Any] = dict(
                model_type=model_type,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                rope_scaling=rope_scaling(config, rope),
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                raw=config,
            )
            common.update(family.load().parse_config(config))
            return cls(**common)
        except KeyError as exc:
            raise ModelConfigError(f"{source}: required field {exc.args[0]!r} is missing") from exc
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"{source}: {exc}") from exc

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``<model_dir>/config.json``."""
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(
                f"{path} does not exist: MODEL must be a Hugging Face model directory "
                f"(config.json + *.safetensors) or a GGUF file"
            ) from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(config, source=str(path))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens (0: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def uses_rope(self, layer: int) -> bool:
        return self.layer_rope[layer] if self.layer_rope else True

    def kv_block_bytes(self, block_size: int, kv_heads: int, element_size: int) -> int:
        """Bytes one paged-KV block takes over every layer (K and V), for `kv_heads` heads
        (a rank's share of them) of `element_size`-byte values: the one formula the runner
        sizes its cache by and the CPU probe its own."""
        return 2 * self.num_layers * block_size * kv_heads * self.head_dim * element_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and (self.moe_layers[layer] if self.moe_layers else True)


def rope_parameters(config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """transformers >= 5 keeps rope settings in `rope_parameters` (per layer type for Gemma 3)."""
    rope = config.get("rope_parameters") or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        return dict(rope[layer_type])
    if isinstance(rope.get("full_attention"), dict):
        return dict(rope["full_attention"])
    return dict(rope)


def rope_scaling(config: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling dict (llama3, linear, longrope, ...), or None for plain RoPE."""
    scaling = config.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return None if kind == "default" else dict(scaling, rope_type=kind)


def sliding_windows(config: dict[str, Any], *, flagged: bool = False) -> tuple[int, ...]:
    """Per-layer windows from `sliding_window` and `layer_types` ("sliding_attention"), or,
    for configs without `layer_types`, every layer from `max_window_layers` on (Qwen2) or
    every layer. `flagged`: only when `use_sliding_window` is set (Qwen2, Qwen3, SmolLM3,
    whose configs carry a window they do not use). () when no layer slides."""
    window = config.get("sliding_window")
    if not window or (flagged and not config.get("use_sliding_window", False)):
        return ()
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        first = int(config.get("max_window_layers", 0)) if flagged else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()
