"""What the C decode step is told about a model: `csrc/tl_vec.h`'s `tl_model` and `tl_layer`
(mirrored in `_decode_structs`), built from the model's modules, and what it cannot take.

The C step asks about operations, not families, as `ModelConfig`'s knobs do: where each
layer's norms sit (read off its class's `forward`: Llama's pre-norm, Gemma's sandwich, OLMo 2's
output norms, Granite's pre-norm with a residual multiplier), q/k norms, the gate's
activation, the attention's scale, soft-cap and window, the layer's rotary table (or none), and
for a mixture-of-experts layer its router and experts. Norm weights go as their float32
scales (`RMSNorm.scale()`: Gemma's 1 + w included); rotary goes as the model's own cos/sin
tables, so every scaling (llama3, linear, longrope and its attention factor) is the torch
path's. With `--enable-lora` each adapted linear's slot buffers (`LoraLinear`, made before
the C step) go as a `tl_lora`: they never move, so their addresses are given once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ..layers._layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from ..layers._moe import FusedMoE
from ..lora._lora_slots import LoraLinear
from ..models.gemma import GemmaDecoderLayer
from ..models.granite import GraniteDecoderLayer
from ..models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from ..models.olmo2 import Olmo2DecoderLayer
from ._decode_structs import (
    ACTIVATIONS,
    LORA_MAX_PARTS,
    MAX_GROUP,
    QK_NORMS,
    Experts,
    LayerWeights,
    Lora,
    Model,
)
from ._hugepages import huge_zeros
from ._tiles import DENSE, TiledLinear, Tiles, dense_tiles, weight_tiles

# Each known layer `forward`: its norms' attribute names as (before attention, before the
# MLP, on attention's output, on the MLP's output), and whether the blocks' outputs are
# scaled by `residual_multiplier`.
_PLACEMENTS: dict[Callable[..., torch.Tensor], tuple[tuple[str | None, ...], bool]] = {
    LlamaDecoderLayer.forward: (("input_layernorm", "post_attention_layernorm", None, None), False),
    GraniteDecoderLayer.forward: (
        ("input_layernorm", "post_attention_layernorm", None, None),
        True,
    ),
    GemmaDecoderLayer.forward: (
        (
            "input_layernorm",
            "pre_feedforward_layernorm",
            "post_attention_layernorm",
            "post_feedforward_layernorm",
        ),
        False,
    ),
    Olmo2DecoderLayer.forward: (
        (None, None, "post_attention_layernorm", "post_feedforward_layernorm"),
        False,
    ),
}


class CpuDecodeUnsupported(RuntimeError):
    """This model or setup is outside what the C decode step covers; says what."""


def model_struct(model: LlamaForCausalLM, block_size: int) -> Model:
    """The model's `tl_model` (call `unsupported` first)."""
    cfg = model.config
    layers = model.decoder_layers()
    attn = layers[0].self_attn
    moe = next((layer.mlp for layer in layers if isinstance(layer.mlp, FusedMoE)), None)
    _, scaled = _PLACEMENTS[type(layers[0]).forward]
    lora = layers[0].self_attn.qkv_proj.lora
    return Model(
        num_layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate=cfg.intermediate_size,
        block_size=block_size,
        cache_type=DENSE[model.embed_tokens.weight.dtype],
        qk_norm=QK_NORMS[cfg.qk_norm],
        rotary_dim=model.rotary.rotary_dim,
        act=ACTIVATIONS[cfg.hidden_act],
        num_experts=0 if moe is None else moe.num_experts,
        top_k=0 if moe is None else moe.top_k,
        expert_intermediate=0 if moe is None else moe.shard,
        renormalize=bool(moe is not None and moe.renormalize),
        lora_rank=0 if lora is None else lora.max_rank,
        lora_type=DENSE[lora.a.dtype] if lora is not None else 0,
        eps=cfg.rms_norm_eps,
        scale=attn.scale,
        softcap=attn.softcap,
        residual=cfg.residual_multiplier if scaled else 1.0,
    )


def layer_weights(layer: LlamaDecoderLayer, amx: bool = False) -> LayerWeights:
    """One layer's tiles (a GGUF weight's own, or tiled copies of dense ones: AMX tiles for
    bfloat16 with `amx`, but not the experts') and scales."""
    attn, mlp = layer.self_attn, layer.mlp
    names, _ = _PLACEMENTS[type(layer).forward]
    norms = [None if name is None else _scale(getattr(layer, name)) for name in names]
    rotary = attn.rotary
    gate_up = down = None
    if isinstance(mlp, LlamaMLP):
        gate_up = _tiles(mlp.gate_up_proj.quantized, mlp.gate_up_proj.weight, amx, interleaved=True)
        down = _tiles(mlp.down_proj.quantized, mlp.down_proj.weight, amx)
    return LayerWeights(
        norms,
        None if attn.q_norm is None else _scale(attn.q_norm),
        None if attn.k_norm is None else _scale(attn.k_norm),
        _tiles(attn.qkv_proj.quantized, attn.qkv_proj.weight, amx),
        _tiles(attn.o_proj.quantized, attn.o_proj.weight, amx),
        gate_up,
        down,
        None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data.float().contiguous(),
        None if attn.o_proj.bias is None else attn.o_proj.bias.data.float().contiguous(),
        None if rotary is None else (rotary.cos, rotary.sin),
        attn.window,
        _experts(mlp) if isinstance(mlp, FusedMoE) else None,
        _lora(layer),
    )


def unsupported(model: LlamaForCausalLM, dtype: torch.dtype) -> str:
    """Why `model` cannot take the C step, or "" when it can."""
    cfg = model.config
    gap = architecture_gap(model)
    if gap:
        return f"the C step has no {gap} yet"
    if model.embed_tokens.tp.world_size != 1:
        return "tensor parallel: the C step runs one rank's whole layer"
    if dtype not in DENSE:
        return f"dtype {dtype}: float32 and bfloat16 only"
    layers = model.decoder_layers()
    for layer in layers:
        for linear in _linears(layer):
            if linear.quantized is not None and not isinstance(linear.quantized, TiledLinear):
                return "GGUF weights kept quantized for torch's int4 kernels"
            if linear.quantized is None and linear.weight.numel() == 0:
                return "the dense weights are gone (it must be built before pack_linears)"
        mlp = layer.mlp
        if isinstance(mlp, LlamaMLP):
            kept = mlp.gate_up_proj.quantized
            if isinstance(kept, TiledLinear) and not kept.interleaved:
                return "the gate/up tiles are not interleaved"
        elif isinstance(mlp, FusedMoE):
            why = _experts_unsupported(mlp)
            if why:
                return why
        else:
            return f"an MLP of type {type(mlp).__name__}"
    head = model.lm_head
    if head.quantized_head is not None and not isinstance(head.quantized_head, TiledLinear):
        return "the LM head is kept quantized for torch's kernels"
    if any(isinstance(layer.mlp, LlamaMLP) for layer in layers) and cfg.intermediate_size % 16:
        return f"intermediate_size {cfg.intermediate_size} is not a multiple of 16"
    if cfg.num_heads // cfg.num_kv_heads > MAX_GROUP:
        return f"more than {MAX_GROUP} query heads per kv head"
    return ""


def architecture_gap(model: LlamaForCausalLM) -> str:
    """What of the model's architecture the C step lacks ("" when it has all of it)."""
    cfg = model.config
    layers = model.decoder_layers()
    forwards = {type(layer).forward for layer in layers}
    gaps = [
        (
            not forwards <= _PLACEMENTS.keys() or len(forwards) > 1,
            "norms placed other than Llama's, Gemma's, OLMo 2's or Granite's",
        ),
        (cfg.hidden_act not in ACTIVATIONS, f"{cfg.hidden_act} activation"),
        (cfg.qk_norm not in QK_NORMS, f"q/k norm {cfg.qk_norm!r}"),
        (
            len({(layer.self_attn.scale, layer.self_attn.softcap) for layer in layers}) > 1,
            "attention scale or soft-cap that differs by layer",
        ),
    ]
    return ", ".join(what for gap, what in gaps if gap)


def _experts_unsupported(moe: FusedMoE) -> str:
    if moe.act not in ACTIVATIONS:
        return f"{moe.act} experts"
    if moe.shard % 16:
        return f"moe_intermediate_size {moe.shard} is not a multiple of 16"
    kinds = set()
    for gate_up, down in moe.quantized or ():
        if not (isinstance(gate_up, TiledLinear) and isinstance(down, TiledLinear)):
            return "GGUF experts kept quantized for torch's kernels"
        kinds.add((gate_up.tiles.kind, down.tiles.kind, gate_up.interleaved))
    if len(kinds) > 1:
        return "GGUF experts of more than one quantization type in a layer"
    return ""


def _linears(layer: LlamaDecoderLayer) -> list[ColumnParallelLinear | RowParallelLinear]:
    attn, mlp = layer.self_attn, layer.mlp
    linears: list[ColumnParallelLinear | RowParallelLinear] = [attn.qkv_proj, attn.o_proj]
    if isinstance(mlp, LlamaMLP):
        linears += [mlp.gate_up_proj, mlp.down_proj]
    return linears


def _lora(layer: LlamaDecoderLayer) -> ctypes.Array[Lora] | None:
    """The layer's `tl_lora`s (qkv, o, gate/up, down; a linear without slots left NULL), or
    None with LoRA off. The buffers are the `LoraLinear`s', which live as long as the model."""
    linears = [(lin.lora if lin is not None else None) for lin in _adapted(layer)]
    if all(lora is None for lora in linears):
        return None
    structs = (Lora * 4)()
    for s, lora in zip(structs, linears, strict=True):
        if lora is not None:
            _fill_lora(s, lora)
    return structs


def _adapted(layer: LlamaDecoderLayer) -> list[ColumnParallelLinear | RowParallelLinear | None]:
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, LlamaMLP):
        return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return [attn.qkv_proj, attn.o_proj, None, None]


def _fill_lora(s: Lora, lora: LoraLinear) -> None:
    if lora.bt is None or len(lora.parts) > LORA_MAX_PARTS:
        raise CpuDecodeUnsupported("LoRA slots without the C step's layout (made on the CPU)")
    s.a, s.bt, s.ranks = lora.a.data_ptr(), lora.bt.data_ptr(), lora.ranks.data_ptr()
    s.parts, s.tiles = len(lora.parts), lora.bt.shape[1]
    ends = torch.tensor(lora.parts).cumsum(0).tolist()
    for p, end in enumerate(ends):
        s.part_end[p] = end


def _scale(norm: RMSNorm) -> torch.Tensor:
    return norm.scale().contiguous()


def _tiles(kept: object, weight: torch.Tensor, amx: bool, *, interleaved: bool = False) -> Tiles:
    """The tiles a weight kept quantized already has, or a tiled copy of the dense one."""
    if isinstance(kept, TiledLinear):
        return kept.tiles
    tiles = weight_tiles(weight.data, amx)
    return tiles.interleaved() if interleaved else tiles


def _experts(moe: FusedMoE) -> Experts:
    """The router tiled, and every expert's tiles: GGUF's `TiledLinear`s as they are (gate/up
    in two halves), dense experts tiled here into one tensor each for gate/up (interleaved,
    as the dense MLP's) and down."""
    router = dense_tiles(moe.gate.weight.data)
    if moe.quantized is not None:
        gate_up = [_kept(gu) for gu, _ in moe.quantized]
        down = [_kept(d) for _, d in moe.quantized]
        first = moe.quantized[0][0]
        interleaved = isinstance(first, TiledLinear) and first.interleaved
    else:
        gate_up = [_stacked(moe.w13.data, interleaved=True)]
        down = [_stacked(moe.w2.data, interleaved=False)]
        interleaved = True
    return Experts(
        router,
        gate_up,
        down,
        interleaved,
        _pointers(gate_up, moe.num_experts),
        _pointers(down, moe.num_experts),
    )


def _kept(weight: object) -> Tiles:
    if not isinstance(weight, TiledLinear):  # `_experts_unsupported` refused these
        raise CpuDecodeUnsupported("GGUF experts kept quantized for torch's kernels")
    return weight.tiles


def _stacked(weights: torch.Tensor, *, interleaved: bool) -> Tiles:
    """[E, N, K] experts -> one tiled tensor [E, tiles of one expert...], filled in place."""
    first = dense_tiles(weights[0])
    data = huge_zeros((weights.shape[0], *first.data.shape), first.data.dtype)
    for e in range(weights.shape[0]):
        tiles = first if e == 0 else dense_tiles(weights[e])
        data[e] = (tiles.interleaved() if interleaved else tiles).data
    return Tiles(data, first.kind)


def _pointers(tiles: list[Tiles], num_experts: int) -> ctypes.Array[ctypes.c_void_p]:
    """Each expert's tiles' address: one tensor each, or rows of one stacked tensor."""
    if len(tiles) == num_experts:
        addresses = [t.data.data_ptr() for t in tiles]
    else:
        data = tiles[0].data
        step = data[0].numel() * data.element_size()
        addresses = [data.data_ptr() + e * step for e in range(num_experts)]
    return (ctypes.c_void_p * num_experts)(*addresses)
