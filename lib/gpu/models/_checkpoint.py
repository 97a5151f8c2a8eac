"""Loading a Hugging Face checkpoint into the decoder (`CheckpointModel`, the base of
`LlamaForCausalLM` and so of every family), and the weights' sizes.

Each checkpoint tensor is split into this rank's shard as it arrives; q/k/v and gate/up go
into their merged linears by part (`_MERGED`); GGUF blocks stay quantized when asked and are
packed for their kernels once all parts are in. A family renames its checkpoint's names in
`checkpoint_name`; a block that loads its own names (experts) has `load_checkpoint`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..layers._layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from ..layers._moe import FusedMoE
from ..quant._gguf_blocks import QuantizedTensor
from ._model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class CheckpointModel(nn.Module):
    """What a decoder needs to load a checkpoint: its config, embedding, layers, final norm
    and head (set by the subclass's constructor)."""

    config: ModelConfig
    embed_tokens: VocabParallelEmbedding
    lm_head: VocabParallelEmbedding
    norm: RMSNorm
    layers: Any  # nn.ModuleList of the family's decoder layers

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
        *,
        keep_quantized: bool = False,
    ) -> set[str]:
        """Load Hugging Face-named tensors, each split into this rank's shard.

        Args:
            keep_quantized: keep `QuantizedTensor`s (GGUF blocks) quantized, for the
                `_quantized` kernels; otherwise they are dequantised to float32 as they arrive.

        Returns:
            The checkpoint names loaded.

        Raises:
            KeyError: a tensor the model does not have (a different architecture).
        """
        loaded = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if isinstance(tensor, QuantizedTensor) and not keep_quantized:
                tensor = tensor.dequantize()
            self._load_one(name, tensor)
            loaded.add(name)
        if keep_quantized:
            self._finish_quantized()
        return loaded

    def _finish_quantized(self) -> None:
        """Pack every kept quantized weight for its kernel, once all parts are in."""
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear | FusedMoE):
                module.finish_quantized()
        tied = self.lm_head is self.embed_tokens
        self.embed_tokens.finish_quantized(lookup=True, head=tied)
        if not tied:
            self.lm_head.finish_quantized(lookup=False, head=True)

    def weight_bytes(self) -> int:
        """Bytes the weights take in memory, dense, packed for oneDNN or quantized."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for module in self.modules():
            for name in ("packed", "packed_head"):
                packed = getattr(module, name, None)
                if isinstance(packed, torch.Tensor):
                    total += packed.numel() * packed.element_size()
            for name in ("quantized", "quantized_head", "quantized_table"):
                kept = getattr(module, name, None)
                if kept is not None:
                    total += kept.nbytes
            total += getattr(module, "quantized_bytes", 0)
        return total

    def decode_read_bytes(self) -> int:
        """Bytes of weights one decode step of one token reads: all but the embedding table,
        of which it reads a row a token (the head reads its own copy, unless it multiplies
        the table), and of the experts only the ones a token is routed to."""
        table = self.embed_tokens
        unread = sum(getattr(m, "unread_bytes_per_token", int)() for m in self.modules())
        if table.quantized_table is not None:
            return self.weight_bytes() - table.quantized_table.nbytes - unread
        if table.packed_head is None and table.quantized_head is None and table is self.lm_head:
            return self.weight_bytes() - unread  # the dense table is the head
        return self.weight_bytes() - table.weight.numel() * table.weight.element_size() - unread

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint's name in this module's terms (families rename theirs)."""
        return name

    def _load_one(self, name: str, tensor: torch.Tensor | QuantizedTensor) -> None:
        name = self.checkpoint_name(name)
        if name == "model.embed_tokens.weight":
            self.embed_tokens.load(tensor)
            return
        if name == "lm_head.weight":
            if not self.config.tie_word_embeddings:
                self.lm_head.load(tensor)
            return
        if name == "model.norm.weight":
            self.norm.load(_dense(tensor))
            return
        match = _LAYER.match(name)
        if match is None or "." not in match.group(2):
            raise KeyError(f"checkpoint tensor {name!r} is not part of a {self.family} model")
        layer = self.layers[int(match.group(1))]
        path, kind = match.group(2).rsplit(".", 1)
        is_bias = kind == "bias"
        loader = getattr(layer.get_submodule(path.split(".")[0]), "load_checkpoint", None)
        if loader is not None and loader(path.split(".", 1)[1], tensor, is_bias=is_bias):
            return  # a block that loads its own names (experts)
        target, part = _MERGED.get(path, (path, None))
        try:
            module = layer.get_submodule(target)
        except AttributeError:
            raise KeyError(
                f"checkpoint tensor {name!r} is not part of a {self.family} model"
            ) from None
        if isinstance(module, ColumnParallelLinear):
            if part is None:  # a fused checkpoint tensor (Phi-3's qkv_proj): every part
                module.load_fused(tensor, is_bias=is_bias)
            else:
                module.load(part, tensor, is_bias=is_bias)
        elif isinstance(module, RowParallelLinear):
            module.load(tensor, is_bias=is_bias)
        elif isinstance(module, RMSNorm) and not is_bias:
            module.load(_dense(tensor))
        else:
            raise KeyError(f"checkpoint tensor {name!r} is not part of a {self.family} model")

    @property
    def family(self) -> str:
        return self.config.model_type


def _dense(tensor: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
