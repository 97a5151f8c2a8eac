"""SmolLM3: Llama's decoder in which every N-th layer has no rotary embedding (NoPE).

`no_rope_layers[i]` is 1 where layer i rotates q and k, 0 where it attends without positions
(every `no_rope_layer_interval`-th layer when the list is absent, as transformers fills it).
"""

from __future__ import annotations

from typing import Any

from ._model_config import sliding_windows
from .llama import LlamaForCausalLM


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    rope = raw.get("no_rope_layers")
    if rope is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rope) != layers:
        raise ValueError(f"no_rope_layers has {len(rope)} entries for {layers} layers")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        layer_rope=tuple(bool(r) for r in rope),
        layer_windows=sliding_windows(raw, flagged=True),
    )


MODEL = LlamaForCausalLM
