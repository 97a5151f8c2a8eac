"""A Llama-family model's shape, read once from its Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelConfigError(ValueError):
    """The model's configuration is missing, malformed, or describes an unsupported model."""


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's hyper-parameters (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

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
    qkv_bias: bool  # Qwen2; Llama's `attention_bias` (which also biases o_proj)
    o_bias: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict.

        Raises:
            ModelConfigError: an unsupported `model_type` or a missing required field.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: model_type {model_type!r} is not supported; trillm runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family) models"
            )
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            attention_bias = bool(config.get("attention_bias", False))
            rope = config.get("rope_parameters") or {}  # transformers >= 5 puts rope here
            return cls(
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
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type != "qwen2" and attention_bias,
                rope_scaling=_rope_scaling(config, rope),
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                sliding_window=_sliding_window(config, model_type),
                raw=config,
            )
        except KeyError as exc:
            raise ModelConfigError(f"{source}: required field {exc.args[0]!r} is missing") from exc

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


def _rope_scaling(config: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling dict (llama3, linear, ...), or None for plain RoPE."""
    scaling = config.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return None if kind == "default" else dict(scaling, rope_type=kind)


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    """Mistral's and Qwen2's sliding window, when the config turns it on."""
    window = config.get("sliding_window")
    if window is None or not config.get("use_sliding_window", model_type == "mistral"):
        return None
    return int(window)
