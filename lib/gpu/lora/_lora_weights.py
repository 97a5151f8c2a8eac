"""Reading a LoRA adapter in PEFT's format, checked against the served model.

A PEFT adapter is a directory: `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`) and `adapter_model.safetensors` with, per adapted linear,
`...layers.{i}.{self_attn|mlp}.{target}.lora_A.weight` [r, in] and `lora_B.weight` [out, r].
The delta of a linear is `scaling * B @ A @ x`, scaling `lora_alpha / r` (rsLoRA:
`lora_alpha / sqrt(r)`); it is folded into B here, once, as vLLM does.

Everything that can be wrong is found here, before any slot is touched, and raised as
`LoraAdapterError` naming the adapter and what to change: files that cannot be read safely
(`_lora_files`: a pickle, `adapter_model.bin`, is never unpickled), a target other than
q/k/v/o_proj and gate/up/down_proj, a rank over `--max-lora-rank`, features that PEFT's merged
model would not match (DoRA, biases, modules_to_save, per-module ranks), weights that are not
float or not finite, and shapes or layers that do not fit the served model (an adapter of
another base model). The bytes checked are kept (`keep_checked_copy`) and are what every
later read takes: an adapter evicted from host memory is read again from that copy.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from safetensors.torch import load as load_safetensors

from ...common.wire import LoraModule
from ..models._model_config import ModelConfig
from ._lora_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    LoraAdapterError,
    keep_checked_copy,
    read_checked_files,
)

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_HEADER_ROOM = 1 << 20  # a safetensors header: about 150 bytes a tensor
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


def weights_cap(config: ModelConfig, max_rank: int) -> int:
    """The most bytes an `adapter_model.safetensors` for `config` may have: every target of
    every layer at rank `max_rank` in float32, plus room for the header."""
    shapes = linear_shapes(config)
    targets = ATTENTION_TARGETS if config.num_experts else TARGETS
    per_layer = sum(max_rank * sum(shapes[t]) for t in targets)
    return per_layer * config.num_layers * 4 + _HEADER_ROOM


def read_adapter(
    module: LoraModule, config: ModelConfig, max_rank: int, *, cache_dir: str = ""
) -> LoraAdapter:
    """Read and check the adapter of `module` for the served model `config`.

    Its bytes come from its checked copy in `cache_dir` when there is one, else from its
    path, read safely (`_lora_files`); once checked, they are kept there (`cache_dir` ""
    keeps none). The adapter's module carries its digest.

    Raises:
        LoraAdapterError: the adapter cannot be served (the message says why and what to do).
    """
    files = read_checked_files(
        module.name,
        module.path,
        module.digest,
        cache_dir,
        max_weights_bytes=weights_cap(config, max_rank),
    )
    adapter = check_adapter(module, files, config, max_rank)
    if cache_dir:
        keep_checked_copy(module.name, cache_dir, files)
    return adapter


def check_adapter(
    module: LoraModule, files: AdapterFiles, config: ModelConfig, max_rank: int
) -> LoraAdapter:
    """The adapter `files` hold, checked against the served model `config`.

    Raises:
        LoraAdapterError: the adapter cannot be served (the message says why and what to do).
    """
    fail = _failer(module)
    try:
        raw = json.loads(files.config)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise fail(f"{CONFIG_FILE} is not JSON: {exc}") from None
    rank, scaling, targets = _check_config(raw, config, max_rank, fail)
    try:
        tensors = load_safetensors(files.weights)
    except Exception as exc:  # safetensors raises its own SafetensorError and others
        raise fail(f"{WEIGHTS_FILE} is not a safetensors file: {exc}") from None
    weights = _pair_tensors(tensors, config, rank, targets, fail)
    scaled = {key: (a.float(), (b.float() * scaling)) for key, (a, b) in weights.items()}
    for (layer, target), pair in scaled.items():
        if not all(bool(torch.isfinite(t).all()) for t in pair):
            raise fail(
                f"layer {layer} {target}: its weights hold NaN or infinite values (after the "
                f"scaling lora_alpha / r = {scaling:g}): the adapter is broken"
            )
    module = msgspec.structs.replace(module, digest=files.digest)
    return LoraAdapter(module, rank, scaled, files.digest)


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
        if a.dtype not in _FLOATS or b.dtype not in _FLOATS:
            raise fail(
                f"layer {layer} {target}: lora_A is {a.dtype} and lora_B {b.dtype}: only "
                f"float16, bfloat16 and float32 are served"
            )
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
