"""ctypes mirrors of the C step's structs (`csrc/tl_vec.h`'s `tl_layer` and `tl_model`,
`csrc/tl_lora.h`'s `tl_lora`), and the weights a `tl_layer` points at.

Why: their fields must match the C structs exactly (order, types and the csrc constants
here), so they sit apart from the code that reads them off a model (`_cpu_decode_model`);
the C code has only the addresses, so `LayerWeights` holds the tensors they point at.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ._tiles import Tiles

MAX_GROUP = 16  # query heads per kv head (csrc: MAX_GROUP)
LORA_MAX_PARTS = 3  # csrc: LORA_MAX_PARTS (q, k, v)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # csrc: ACT_SILU, ACT_GELU_TANH
QK_NORMS = {"": 0, "head": 1, "projection": 2}  # csrc: QK_NONE, QK_HEAD, QK_PROJECTION
_NORMS = ("ln1", "ln2", "ln_attn_out", "ln_ff_out")


class Layer(ctypes.Structure):
    """`struct tl_layer`."""

    _fields_ = [
        *(
            (name, ctypes.c_void_p)
            for name in (
                *_NORMS, "q_norm", "k_norm", "wqkv", "wo", "wgu", "wd", "bqkv", "bo",
                "rope_cos", "rope_sin", "router", "expert_gu", "expert_down", "k_cache",
                "v_cache", "lora",
            )
        ),
        *(
            (name, ctypes.c_int32)
            for name in (
                "tqkv", "to", "tgu", "td", "trouter", "tegu", "ted", "egu_interleaved", "window"
            )
        ),
    ]  # fmt: skip


class Model(ctypes.Structure):
    """`struct tl_model`."""

    _fields_ = [
        *(
            (name, ctypes.c_int32)
            for name in (
                "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                "block_size", "cache_type", "qk_norm", "rotary_dim", "act", "num_experts",
                "top_k", "expert_intermediate", "renormalize", "lora_rank", "lora_type",
            )
        ),
        *((name, ctypes.c_float) for name in ("eps", "scale", "softcap", "residual")),
    ]  # fmt: skip


class Lora(ctypes.Structure):
    """`struct tl_lora`: one adapted linear's slot buffers."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("bt", ctypes.c_void_p),
        ("ranks", ctypes.c_void_p),
        ("parts", ctypes.c_int32),
        ("tiles", ctypes.c_int32),
        ("part_end", ctypes.c_int32 * LORA_MAX_PARTS),
    ]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@dataclass
class Experts:
    """A mixture-of-experts layer's tiles: the router, and each expert's gate/up and down
    (one tensor for all of them when tiled here, each its own when GGUF's)."""

    router: Tiles
    gate_up: list[Tiles]
    down: list[Tiles]
    interleaved: bool  # gate/up tiles 2j, 2j + 1 (else the two halves: GGUF's `TiledLinear`)
    gate_up_ptrs: ctypes.Array[ctypes.c_void_p]
    down_ptrs: ctypes.Array[ctypes.c_void_p]

    def tiles(self) -> list[Tiles]:
        return [self.router, *self.gate_up, *self.down]


@dataclass
class LayerWeights:
    """What one `tl_layer` points at (held here: the C code has only the addresses)."""

    norms: list[torch.Tensor | None]  # ln1, ln2, ln_attn_out, ln_ff_out
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Tiles
    o: Tiles
    gate_up: Tiles | None  # None on a mixture-of-experts layer
    down: Tiles | None
    bqkv: torch.Tensor | None
    bo: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor] | None  # the layer's rotary cos and sin tables
    window: int
    experts: Experts | None
    lora: ctypes.Array[Lora] | None = None  # qkv, o, gate/up, down (`--enable-lora`)

    def tiles(self) -> list[Tiles]:
        dense = [t for t in (self.qkv, self.o, self.gate_up, self.down) if t is not None]
        return dense + (self.experts.tiles() if self.experts is not None else [])

    def fill(self, s: Layer) -> None:
        """Point `s` at these weights (all but the KV cache)."""
        for name, norm in zip(_NORMS, self.norms, strict=True):
            setattr(s, name, _ptr(norm))
        s.q_norm, s.k_norm = _ptr(self.q_norm), _ptr(self.k_norm)
        s.wqkv, s.tqkv = self.qkv.data.data_ptr(), self.qkv.kind
        s.wo, s.to = self.o.data.data_ptr(), self.o.kind
        if self.gate_up is not None and self.down is not None:
            s.wgu, s.tgu = self.gate_up.data.data_ptr(), self.gate_up.kind
            s.wd, s.td = self.down.data.data_ptr(), self.down.kind
        s.bqkv, s.bo = _ptr(self.bqkv), _ptr(self.bo)
        if self.rope is not None:
            s.rope_cos, s.rope_sin = (t.data_ptr() for t in self.rope)
        s.window = self.window
        if self.experts is not None:
            e = self.experts
            s.router, s.trouter = e.router.data.data_ptr(), e.router.kind
            s.expert_gu = ctypes.cast(e.gate_up_ptrs, ctypes.c_void_p)
            s.expert_down = ctypes.cast(e.down_ptrs, ctypes.c_void_p)
            s.tegu, s.ted, s.egu_interleaved = e.gate_up[0].kind, e.down[0].kind, e.interleaved
        if self.lora is not None:
            s.lora = ctypes.cast(self.lora, ctypes.c_void_p)
