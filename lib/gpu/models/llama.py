"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) with a paged KV cache, and
the base every other family's module builds on.

The batch is flattened: every tensor is [T, ...] over this step's tokens of all sequences, so
prefill chunks and decodes run in one forward with no padding. q/k/v and gate/up are merged
into one matmul each; Hugging Face weights are split into them by `load_weights`, which keeps
GGUF's Q8_0 / Q4_0 / Q4_1 weights quantized when asked (`--quantization gguf`, `_quantized`).

What the other families change is read from `ModelConfig`'s knobs (q/k norms, windows,
soft-caps, multipliers, partial or absent rotary) by these classes, or is structure their
own modules override: `LlamaDecoderLayer.forward` (where the norms sit), `make_mlp` (experts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..attention._attention import QkvAttention, StepAttention
from ..cpu._cpu_ops import cpu_norms, gated
from ..layers._layers import (
    ColumnParallelLinear,
    NormOps,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from ..layers._parallel import TensorParallel
from ..layers._rotary import Rope, RotaryEmbedding
from ._checkpoint import CheckpointModel
from ._model_config import ModelConfig, sliding_windows

if TYPE_CHECKING:
    from ..layers._fused_kernels import FusedOps

KVCache = tuple[torch.Tensor, torch.Tensor]
Meta = StepAttention | QkvAttention


def parse_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Llama's `attention_bias` biases q, k, v and o; Qwen2 always biases q, k, v alone;
    Mistral slides every layer when the config has a window, Qwen2 when it says so."""
    model_type = raw["model_type"]
    bias = bool(raw.get("attention_bias", False))
    return dict(
        qkv_bias=model_type == "qwen2" or bias,
        o_bias=model_type != "qwen2" and bias,
        layer_windows=sliding_windows(raw, flagged=model_type == "qwen2"),
    )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding | None,
        tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads = tp.split(config.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(config.num_kv_heads, "num_key_value_heads")
        self.head_dim = d
        self.scale = config.attention_scale if config.attention_scale is not None else d**-0.5
        self.window = config.window(layer)
        self.softcap = config.attn_logit_softcap
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
        self.fused: FusedOps | None = None  # CUDA: rotary + KV write in one kernel
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm == "head":  # Qwen3, Gemma 3: each head normed on its own
            self.q_norm = RMSNorm(d, eps, dtype, offset=offset)
            self.k_norm = RMSNorm(d, eps, dtype, offset=offset)
        elif config.qk_norm == "projection":  # OLMo 2: the whole q (k) projection
            self.q_norm = RMSNorm(config.num_heads * d, eps, dtype, offset=offset, tp=tp)
            self.k_norm = RMSNorm(config.num_kv_heads * d, eps, dtype, offset=offset, tp=tp)

    def forward(
        self, rope: Rope | None, hidden: torch.Tensor, kv_cache: KVCache, meta: Meta
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if isinstance(meta, QkvAttention):  # rotary, KV write and attention in one call
            fused: torch.Tensor = self.o_proj(meta.attend_qkv(qkv, kv_cache[0], kv_cache[1]))
            return fused
        if self.fused is not None and rope is not None and self.q_norm is None:
            out = self.fused.rope_attend(
                qkv, rope, kv_cache, meta, self.num_heads, self.num_kv_heads,
                self.scale, self.window, self.softcap,
            )  # fmt: skip
            rotated: torch.Tensor = self.o_proj(out.flatten(1))
            return rotated
        q, k = self._rotated_qk(rope, qkv)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale, self.window, self.softcap)
        result: torch.Tensor = self.o_proj(out.flatten(1))
        return result

    def _rotated_qk(
        self, rope: Rope | None, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D], normed and rotated as the config says."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None or self.k_norm is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, h + hkv, d)
            if rope is not None and self.rotary is not None:  # q and k heads in one pass
                qk = self.rotary.rotate(qk, rope)
            return qk[:, :h], qk[:, h:]
        q_flat, k_flat = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        if self.q_norm.full_size == d:  # per head
            q, k = self.q_norm(q_flat.view(-1, h, d)), self.k_norm(k_flat.view(-1, hkv, d))
        else:
            q, k = self.q_norm(q_flat).view(-1, h, d), self.k_norm(k_flat).view(-1, hkv, d)
        if rope is not None and self.rotary is not None:
            q, k = self.rotary.rotate(q, rope), self.rotary.rotate(k, rope)
        return q, k


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.act = config.hidden_act
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
        self.fused: FusedOps | None = None  # CUDA: SiLU * up in one kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and self.act == "silu":
            act = self.fused.silu_mul(gate_up)
        else:
            act = gated(gate_up, self.act)
        result: torch.Tensor = self.down_proj(act)
        return result


class LlamaDecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). Families with other norm
    placements override `forward` and name their norms in `norm_names`."""

    norm_names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding | None,
        tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.residual_multiplier = config.residual_multiplier
        for name in self.norm_names:
            setattr(self, name, self.make_norm(config, dtype))
        self.self_attn = LlamaAttention(config, layer, rotary, tp, dtype)
        self.mlp = self.make_mlp(config, layer, tp, dtype)

    @staticmethod
    def make_norm(config: ModelConfig, dtype: torch.dtype) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, offset=config.norm_offset)

    def make_mlp(
        self, config: ModelConfig, layer: int, tp: TensorParallel, dtype: torch.dtype
    ) -> nn.Module:
        return LlamaMLP(config, tp, dtype)

    def forward(
        self, rope: Rope | None, hidden: torch.Tensor, kv: KVCache, meta: Meta
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv, meta)
        result: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return result

    def forward_fused(
        self,
        fused: NormOps,
        rope: Rope | None,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv: KVCache,
        meta: Meta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with each residual add fused into the norm after it (vLLM's layout):
        takes the previous layer's MLP output and the residual stream before it (None: the
        first layer, `hidden` is the embedding), returns this layer's pair. The sums are the
        same adds in the model's dtype (x + y rounds as y + x), so the numbers are too (to
        float32 rounding on the CPU, whose C norm sums the squares in its own order)."""
        norm = self.input_layernorm
        if residual is None:
            x, residual = fused.rms_norm(hidden, norm.weight, norm.eps, norm.offset), hidden
        else:
            x, residual = fused.add_rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)
        attn = self.self_attn(rope, x, kv, meta)
        norm = self.post_attention_layernorm
        x, residual = fused.add_rms_norm(attn, residual, norm.weight, norm.eps, norm.offset)
        return self.mlp(x), residual


class LlamaForCausalLM(CheckpointModel):
    """Embedding, decoder layers, final norm and (tied or own) vocab-parallel LM head."""

    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        # The inject_fault test hook: set by the runner's `FaultHook`, raised by the next
        # forward (so the root cause names this frame), then cleared.
        self.fault: Exception | None = None
        self.fused: FusedOps | None = None  # `use_fused`: CUDA's fused kernels
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype
        )
        rotary_dim = config.rotary_dim or config.head_dim
        positions = config.max_position_embeddings
        self.rotary = RotaryEmbedding(
            rotary_dim, positions, config.rope_theta, config.rope_scaling, dtype
        )
        self.local_rotary = (  # Gemma 3's sliding layers: their own base, unscaled
            None
            if config.local_rope_theta is None
            else RotaryEmbedding(rotary_dim, positions, config.local_rope_theta, None, dtype)
        )
        self.layers = nn.ModuleList(
            self.layer_class(config, i, self._rotary_of(i), tp, dtype)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, offset=config.norm_offset
        )
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype)
        )

    def _rotary_of(self, layer: int) -> RotaryEmbedding | None:
        if not self.config.uses_rope(layer):
            return None
        if self.local_rotary is not None and self.config.window(layer):
            return self.local_rotary
        return self.rotary

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: Meta,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of this step's tokens.

        `embeds` (indexes into the step's tokens, rows [n, hidden]) replace the token
        embedding at those tokens (a prompt sent as embeddings): as transformers'
        `inputs_embeds`, before the embedding multiplier (Gemma's, Granite's).
        """
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault
        hidden = self.embed_tokens(input_ids)
        if embeds is not None:
            index, rows = embeds
            hidden = hidden.index_copy(0, index, rows.to(hidden.dtype))
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        ropes = {id(self.rotary): self.rotary.angles(positions)}
        if self.local_rotary is not None:
            ropes[id(self.local_rotary)] = self.local_rotary.angles(positions)
        norms = self.fused if self.fused is not None else cpu_norms(hidden)
        if norms is not None and self.residual_fusable():
            return self._forward_fused(norms, hidden, ropes, kv_caches, meta)
        for layer, kv in zip(self.decoder_layers(), kv_caches, strict=True):
            rotary = layer.self_attn.rotary
            hidden = layer(None if rotary is None else ropes[id(rotary)], hidden, kv, meta)
        result: torch.Tensor = self.norm(hidden)
        return result

    def _forward_fused(
        self,
        fused: NormOps,
        hidden: torch.Tensor,
        ropes: dict[int, Rope],
        kv_caches: list[KVCache],
        meta: Meta,
    ) -> torch.Tensor:
        """The layers with the residual adds fused into the norms (`forward_fused`): CUDA's
        Triton kernels, or on the CPU in float32 the C ones (`_cpu_ops.CpuNorms`)."""
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.decoder_layers(), kv_caches, strict=True):
            rotary = layer.self_attn.rotary
            rope = None if rotary is None else ropes[id(rotary)]
            hidden, residual = layer.forward_fused(fused, rope, hidden, residual, kv, meta)
        if residual is None:  # no layers
            return fused.rms_norm(hidden, self.norm.weight, self.norm.eps, self.norm.offset)
        norm = self.norm
        return fused.add_rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)[0]

    def residual_fusable(self) -> bool:
        """Whether every layer is Llama's pre-norm block (families that move the norms or
        scale the residual override `forward`, and keep it)."""
        return all(
            type(layer).forward is LlamaDecoderLayer.forward for layer in self.decoder_layers()
        )

    def use_fused(self, on: bool = True) -> None:
        """Run CUDA's fused Triton kernels from now on (`_fused_kernels`): RMSNorm (with the
        residual add where the block is Llama's), rotary with the KV write, SiLU * up.
        Chosen once at load (`_kernels.fused_kernels_for`; `perf/gpu_bench.py` also turns
        them on for the CPU's count, off for CUDA's baseline); imports triton. The rotary
        kernel needs the triton attention backend's metadata."""
        if on:
            from ..layers._fused_kernels import FusedOps

        self.fused = FusedOps() if on else None
        for module in self.modules():
            if isinstance(module, RMSNorm | LlamaAttention | LlamaMLP):
                module.fused = self.fused

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
        return self.finish_logits(self.lm_head.logits(hidden))

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output scaled (Granite) and soft-capped (Gemma) as the config says."""
        cfg = self.config
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits


MODEL = LlamaForCausalLM
