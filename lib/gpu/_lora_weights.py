"""Reading a LoRA adapter in PEFT's format, checked against the served model.

A PEFT adapter is a directory: `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`) and `adapter_model.safetensors` with, per adapted linear,
`...layers.{i}.{self_attn|mlp}.{target}.lora_A.weight` [r, in] and `lora_B.weight` [out, r].
The delta of a linear is `scaling * B @ A @ x`, scaling `lora_alpha / r` (rsLoRA:
`lora_alpha / sqrt(r)`); it is folded into B here, once, as vLLM does.

Everything that can be wrong is found here, before any slot is touched, and raised as
`LoraAdapterError` naming the adapter and what to change: a missing file, a pickle
(`adapter_model.bin` is never unpickled), a target other than q/k/v/o_proj and
gate/up/down_proj, a rank over `--max-lora-rank`, features that PEFT's merged model would
not match (DoRA, biases, modules_to_save, per-module ranks), and shapes or layers that do not
fit the served model (an adapter of another base model).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from ..wire import LoraModule
from ._model_config import ModelConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Settings that change what PEFT computes beyond `B @ A`: refused at their non-default values.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, [], ()),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
}


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message names it and what to change."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights in host memory, full size (each rank takes its shard)."""

    module: LoraModule
    rank: int
    # (layer, target) -> (A [r, in], scaling * B [out, r]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # sha256 of the config and the weights: its identity in the prefix cache

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target of the served model, unsharded."""
    hidden, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter(module: LoraModule, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter of `module` for the served model `config`.

    Raises:
        LoraAdapterError: the adapter cannot be served (the message says why and what to do).
    """
    fail = _failer(module)
    directory = Path(module.path)
    if not directory.is_dir():
        raise fail(f"{module.path!r} is not a directory (a PEFT adapter's)")
    weights_path = directory / "adapter_model.safetensors"
    if not weights_path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise fail(
                "adapter_model.bin is a pickle, which trillm never loads: convert it to "
                "adapter_model.safetensors (peft's save_pretrained(..., "
                "safe_serialization=True), or safetensors.torch.save_file)"
            )
        raise fail(f"no adapter_model.safetensors in {module.path!r}")
    try:
        config_bytes = (directory / "adapter_config.json").read_bytes()
        raw = json.loads(config_bytes)
    except (OSError, json.JSONDecodeError) as exc:
        raise fail(f"adapter_config.json is missing or not JSON: {exc}") from None
    rank, scaling, targets = _check_config(raw, config, max_rank, fail)
    data = weights_path.read_bytes()
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own SafetensorError and others
        raise fail(f"adapter_model.safetensors is not a safetensors file: {exc}") from None
    weights = _pair_tensors(tensors, config, rank, targets, fail)
    digest = hashlib.sha256(config_bytes + data).hexdigest()
    scaled = {key: (a.float(), (b.float() * scaling)) for key, (a, b) in weights.items()}
    return LoraAdapter(module, rank, scaled, digest)


def _failer(module: LoraModule) -> Any:
    def fail(message: str) -> LoraAdapterError:
        return LoraAdapterError(f"LoRA adapter {module.name!r}: {message}")

    return fail


def _check_config(
    raw: Any, config: ModelConfig, max_rank: int, fail: Any
) -> tuple[int, float, set[str]]:
    """(rank, scaling, targets) of a PEFT config, or `fail`'s error."""
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise fail("adapter_config.json is not a LoRA adapter's (peft_type must be LORA)")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise fail(f"rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise fail(f"rank {rank} is over --max-lora-rank {max_rank}: raise --max-lora-rank")
    for key, allowed in _UNSUPPORTED.items():
        if key in raw and raw[key] not in allowed:
            raise fail(f"{key}={raw[key]!r} is not supported (only plain LoRA: A and B)")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float):
        raise fail(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGETS)
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise fail(f"target_modules must list module names, got {targets!r}")
    names = {str(t).rsplit(".", 1)[-1] for t in targets}
    unknown = sorted(names - set(TARGETS))
    if unknown:
        raise fail(f"unsupported target modules {unknown}: only {', '.join(TARGETS)}")
    if config.num_experts and names & set(MLP_TARGETS):
        raise fail(
            f"targets {sorted(names & set(MLP_TARGETS))} of a mixture-of-experts model's MLP "
            f"are not supported: only {', '.join(ATTENTION_TARGETS)}"
        )
    return rank, scaling, names


def _pair_tensors(
    tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, targets: set[str], fail: Any
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The A/B pairs by (layer, target), each checked against the model's shapes."""
    shapes = linear_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.search(name)
        if match is None or match.group(2) not in targets:
            raise fail(f"tensor {name!r} is not a LoRA weight of {', '.join(sorted(targets))}")
        layer, target, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config.num_layers:
            raise fail(
                f"tensor {name!r} is for layer {layer}, but the served model has "
                f"{config.num_layers} layers: the adapter was trained on another base model"
            )
        halves.setdefault((layer, target), {})[half] = tensor
    pairs = {}
    for (layer, target), half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            raise fail(f"layer {layer} {target} has lora_{''.join(half)} without its pair")
        a, b = half["A"], half["B"]
        fan_in, fan_out = shapes[target]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise fail(
                f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit the served model's [{rank}, {fan_in}] and [{fan_out}, {rank}]: the "
                f"adapter was trained on another base model"
            )
        pairs[layer, target] = (a, b)
    if not pairs:
        raise fail("adapter_model.safetensors holds no LoRA weights")
    return pairs
