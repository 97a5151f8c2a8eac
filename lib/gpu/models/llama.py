"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) with a paged KV cache.

The batch is flattened: every tensor is [T, ...] over this step's tokens of all sequences, so
prefill chunks and decodes run in one forward with no padding. q/k/v and gate/up are merged
into one matmul each; Hugging Face weights are split into them by `load_weights`, which keeps
GGUF's Q8_0 / Q4_0 / Q4_1 weights quantized when asked (`--quantization gguf`, `_quantized`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .._attention import QkvAttention, StepAttention
from .._cpu_ops import silu_mul
from .._failure import InjectedFault
from .._gguf_blocks import QuantizedTensor
from .._layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from .._model_config import ModelConfig
from .._parallel import TensorParallel
from .._rotary import Rope, RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, dtype: torch.dtype
    ) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads = tp.split(config.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(config.num_kv_heads, "num_key_value_heads")
        self.head_dim = d
        self.scale = d**-0.5
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d],
            bias=config.qkv_bias,
            tp=tp,
            dtype=dtype,
            what="attention heads",
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * d,
            config.hidden_size,
            bias=config.o_bias,
            tp=tp,
            dtype=dtype,
            what="attention heads",
        )
        self.rotary = rotary

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: StepAttention | QkvAttention,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if isinstance(meta, QkvAttention):  # rotary, KV write and attention in one call
            fused: torch.Tensor = self.o_proj(meta.attend_qkv(qkv, kv_cache[0], kv_cache[1]))
            return fused
        qk_heads = self.num_heads + self.num_kv_heads
        qk = self.rotary.rotate(
            qkv[:, : self.q_size + self.kv_size].view(-1, qk_heads, self.head_dim), rope
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale)
        result: torch.Tensor = self.o_proj(out.flatten(1))
        return result


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [size, size],
            bias=False,
            tp=tp,
            dtype=dtype,
            what="intermediate_size",
            interleaved=True,
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=False, tp=tp, dtype=dtype, what="intermediate_size"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(silu_mul(self.gate_up_proj(x)))
        return result


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, rotary, tp, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, tp, dtype)

    def forward(
        self, rope: Rope, hidden: torch.Tensor, kv: KVCache, meta: StepAttention | QkvAttention
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv, meta)
        result: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return result


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_ROW = {"self_attn.o_proj", "mlp.down_proj"}
_NORMS = {"input_layernorm", "post_attention_layernorm"}


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and (tied or own) vocab-parallel LM head."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.fail_next_forward = False  # the inject_fault test hook
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype
        )
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
        )
        self.rotary = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, tp, dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: StepAttention | QkvAttention,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of this step's tokens."""
        if self.fail_next_forward:
            self.fail_next_forward = False
            raise InjectedFault("injected fault in LlamaForCausalLM.forward (test hook)")
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.angles(positions)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv, meta)
        result: torch.Tensor = self.norm(hidden)
        return result

    def pack_linears(self) -> None:
        """Pack every linear weight and the head for oneDNN (CPU only; see `_cpu_linear`)."""
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                module.pack()
        self.lm_head.pack()
        if self.lm_head is not self.embed_tokens:  # an untied head is only ever multiplied
            self.lm_head.weight.data = torch.empty(0, dtype=self.lm_head.weight.dtype)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """The layers, typed (a ModuleList yields Modules)."""
        return [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits."""
        return self.lm_head.logits(hidden)

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
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
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
        return total

    def decode_read_bytes(self) -> int:
        """Bytes of weights one decode step reads: all but the embedding table, of which it
        reads a row a token (the head reads its own copy, unless it multiplies the table)."""
        table = self.embed_tokens
        if table.quantized_table is not None:
            return self.weight_bytes() - table.quantized_table.nbytes
        if table.packed_head is None and table.quantized_head is None and table is self.lm_head:
            return self.weight_bytes()  # the dense table is the head
        return self.weight_bytes() - table.weight.numel() * table.weight.element_size()

    def _load_one(self, name: str, tensor: torch.Tensor | QuantizedTensor) -> None:
        if name == "model.embed_tokens.weight":
            self.embed_tokens.load(tensor)
            return
        if name == "lm_head.weight":
            if not self.config.tie_word_embeddings:
                self.lm_head.load(tensor)
            return
        if name == "model.norm.weight":
            self.norm.weight.data.copy_(_dense(tensor))
            return
        match = _LAYER.match(name)
        if match is None:
            raise KeyError(f"checkpoint tensor {name!r} is not part of a Llama-family model")
        layer = self.layers[int(match.group(1))]
        path, kind = match.group(2).rsplit(".", 1)
        if path not in _MERGED and path not in _ROW and path not in _NORMS:
            raise KeyError(f"checkpoint tensor {name!r} is not part of a Llama-family model")
        is_bias = kind == "bias"
        module = layer.get_submodule(_MERGED[path][0] if path in _MERGED else path)
        if isinstance(module, ColumnParallelLinear):
            module.load(_MERGED[path][1], tensor, is_bias=is_bias)
        elif isinstance(module, RowParallelLinear):
            module.load(tensor, is_bias=is_bias)
        elif isinstance(module, RMSNorm):
            module.weight.data.copy_(_dense(tensor))
        else:
            raise KeyError(f"checkpoint tensor {name!r} is not part of a Llama-family model")


def _dense(tensor: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
