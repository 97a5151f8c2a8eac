"""llama.cpp's architectures, each seen as the Hugging Face model type it was converted from.

One row per architecture: its model type and class, its config translation (`_gguf_config`),
where each GGUF tensor goes and which of the converter's edits to undo. GGUF names a block's
tensors `blk.{N}.{part}.{weight|bias}` with llama.cpp's part names (`gguf-py/gguf/constants.py`);
which Hugging Face module a part came from depends on the architecture (`tensor_mapping.py`):
`post_attention_layernorm` is `ffn_norm` in Llama but `post_attention_norm` in Gemma and OLMo 2.

The edits of llama.cpp's `convert_hf_to_gguf.py` that the loader undoes:
- Q and K rows (weights and biases) permuted for llama.cpp's interleaved rotary
  (`LlamaModel.permute`): Llama, Mixtral, Granite and SmolLM3, whose converters derive from
  `LlamaModel`. Qwen2, Qwen3, Qwen3-MoE, Gemma, Phi-3 and OLMo 2 are stored as they are.
- Gemma 2 and 3 store every RMSNorm weight plus 1 (`data_torch + 1`), q/k norms included.
- Each projection's experts stacked into one [E, I, H] tensor (`ffn_{gate,up,down}_exps`).
- Phi-3's longrope factors moved from the config into tensors (`rope_factors_long/short`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..models import FAMILIES
from . import _gguf_config as configs
from ._gguf_config import Config
from ._gguf_metadata import GGUFError, Metadata


@dataclass(frozen=True)
class Target:
    """Where one GGUF tensor goes, and what undoes the converter's edit of it."""

    names: tuple[str, ...]  # Hugging Face names: one, one per expert, or none (config only)
    experts: bool = False  # split along the first dimension, one name per expert
    rotary_heads: str = ""  # the config field with its head count: un-permute its rows
    norm_offset: float = 0.0  # subtract: the converter stored offset + weight


@dataclass(frozen=True)
class Architecture:
    """One `general.architecture` as one Hugging Face model type."""

    name: str  # llama.cpp's `general.architecture`
    model_type: str
    hf_class: str
    display: str  # for messages
    translate: Callable[[Metadata, Config], Config]
    blocks: Mapping[str, str]  # GGUF part of block N -> Hugging Face part of model.layers.N
    experts: Mapping[str, str] = field(default_factory=dict)  # ... with {e} for the expert
    permutes_qk: bool = False
    norm_offset: float = 0.0
    partial_rotary: bool = False
    config_tensors: frozenset[str] = frozenset()  # read into the config, not yielded

    def config(self, meta: Metadata) -> Config:
        """The Hugging Face `config.json` dict for this file.

        Raises:
            GGUFError: a required key is missing or the file uses what the family cannot.
        """
        base = configs.base_config(
            meta, self.model_type, self.hf_class, partial_rotary=self.partial_rotary
        )
        return self.translate(meta, base)

    def target(self, name: str, num_experts: int) -> Target | None:
        """Where the GGUF tensor `name` goes, or None when this family has no such tensor.

        Args:
            name: the GGUF tensor name.
            num_experts: its first PyTorch dimension, the expert count of an expert tensor.
        """
        if name in self.config_tensors:
            return Target(())
        if name in _GLOBAL_NAMES:
            offset = self.norm_offset if name == "output_norm.weight" else 0.0
            return Target((_GLOBAL_NAMES[name],), norm_offset=offset)
        match = _BLOCK_NAME.fullmatch(name)
        if match is None:
            return None
        layer, part, suffix = match.groups()
        prefix = f"model.layers.{layer}."
        if part in self.experts and suffix == "weight":
            parts = (self.experts[part].format(e=e) for e in range(num_experts))
            return Target(tuple(f"{prefix}{p}.weight" for p in parts), experts=True)
        hf_part = self.blocks.get(part)
        is_norm = part.endswith("norm")
        if hf_part is None or (suffix == "bias" and (is_norm or not hf_part.endswith("_proj"))):
            return None
        rotary = ""
        if self.permutes_qk and part in _ROTARY_HEADS:
            rotary = _ROTARY_HEADS[part]
        offset = self.norm_offset if is_norm else 0.0
        return Target((f"{prefix}{hf_part}.{suffix}",), rotary_heads=rotary, norm_offset=offset)


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERT_NAME = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")
_ROTARY_HEADS = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}

_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_POST_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    **_POST_NORMS,
    **_ATTENTION,
    **_MLP,
}
_LLAMA = {**_PRE_NORMS, **_ATTENTION, **_MLP}

_ARCHITECTURES = (
    Architecture(
        "llama", "llama", "LlamaForCausalLM", "Llama", configs.llama, _LLAMA, permutes_qk=True
    ),
    Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", "Qwen2", configs.qwen2, _LLAMA),
    Architecture(
        "qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen3", configs.qwen3, {**_LLAMA, **_QK_NORMS}
    ),
    Architecture(
        "qwen3moe",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3-MoE",
        configs.qwen3_moe,
        {**_PRE_NORMS, **_ATTENTION, **_QK_NORMS, "ffn_gate_inp": "mlp.gate"},
        experts={
            "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
            "ffn_up_exps": "mlp.experts.{e}.up_proj",
            "ffn_down_exps": "mlp.experts.{e}.down_proj",
        },
    ),
    Architecture(
        "gemma2", "gemma2", "Gemma2ForCausalLM", "Gemma 2", configs.gemma2, _GEMMA, norm_offset=1.0
    ),
    Architecture(
        "gemma3",
        "gemma3_text",
        "Gemma3ForCausalLM",
        "Gemma 3",
        configs.gemma3,
        {**_GEMMA, **_QK_NORMS},
        norm_offset=1.0,
    ),
    Architecture(
        "phi3",
        "phi3",
        "Phi3ForCausalLM",
        "Phi-3",
        configs.phi3,
        {
            **_PRE_NORMS,
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_up": "mlp.gate_up_proj",  # [gate; up], as Hugging Face stores it
            "ffn_down": "mlp.down_proj",
        },
        partial_rotary=True,
        config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
    ),
    Architecture(
        "olmo2",
        "olmo2",
        "Olmo2ForCausalLM",
        "OLMo 2",
        configs.olmo2,
        {**_POST_NORMS, **_QK_NORMS, **_ATTENTION, **_MLP},
    ),
    Architecture(
        "granite",
        "granite",
        "GraniteForCausalLM",
        "Granite",
        configs.granite,
        _LLAMA,
        permutes_qk=True,
    ),
    Architecture(
        "smollm3",
        "smollm3",
        "SmolLM3ForCausalLM",
        "SmolLM3",
        configs.smollm3,
        _LLAMA,
        permutes_qk=True,
    ),
)
_BY_NAME = {a.name: a for a in _ARCHITECTURES}

# llama.cpp writes Mixtral as `llama` with expert tensors (LlamaModel merges
# block_sparse_moe.experts.*.w1/w2/w3 into ffn_gate/down/up_exps).
MIXTRAL = Architecture(
    "llama",
    "mixtral",
    "MixtralForCausalLM",
    "Mixtral",
    configs.mixtral,
    {**_PRE_NORMS, **_ATTENTION, "ffn_gate_inp": "block_sparse_moe.gate"},
    experts={
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    },
    permutes_qk=True,
)


def supported_architectures() -> tuple[str, ...]:
    """The `general.architecture`s trillm loads: the model registry's, in its order."""
    names = (a for family in FAMILIES for a in family.gguf_architectures)
    return tuple(dict.fromkeys(a for a in names if a in _BY_NAME))


def architecture_for(path: Path, arch: object, tensor_names: Iterable[str]) -> Architecture:
    """The row for a file's `general.architecture` (Mixtral: `llama` with experts).

    Raises:
        GGUFError: the architecture is missing or not supported; the message lists those that are.
    """
    supported = supported_architectures()
    if not isinstance(arch, str) or arch not in supported:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported; trillm loads GGUF files of the "
            f"architectures {', '.join(supported)}"
        )
    if arch == "llama" and any(_EXPERT_NAME.fullmatch(name) for name in tensor_names):
        return MIXTRAL
    return _BY_NAME[arch]
