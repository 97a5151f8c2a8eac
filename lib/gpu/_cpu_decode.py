"""The CPU decode step in one C call (`csrc/cpu_decode.c`): the CPU's answer to CUDA graphs.

Why: a batch-1 decode step of SmolLM2-135M in float32 must read 538 MB of weights. On the
2-core AVX-512 CI machine the torch forward issued 4,972 torch ops a step (norms, rotary,
gathers, SDPA, views, and the 121 linears, each its own OpenMP region) and took 15.75 ms;
this step takes 8.24 ms, reading the weights at 65 GB/s (`perf/decode_profile.py`, both
interleaved in one run). Here every decoder layer runs inside one OpenMP region, over
weights laid out for a matrix-vector product (16-row tiles, k-major), with the KV write and
paged attention in the same pass.

What it covers: steps in which every sequence brings one token (decodes, and one-token
prompts) and there are at most `max_batch` (64) of them, on one rank, in float32 or bfloat16,
dense or GGUF weights kept quantized (the same C tiles, `_tiles`). Other steps (larger decode
steps, prompts, mixed steps) run the torch forward, whose dense linears stay packed for
oneDNN (large GEMMs are its strength), with C's attention (`attention`) unless a prompt's
context passes `PROMPT_CONTEXT_MAX`; tensor parallel runs the torch forward alone. The
price, for dense weights, is a second copy in the tiled layout (logged at load).
`--enforce-eager` turns it off, as it turns CUDA graphs off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from . import _native
from ._attention import QkvAttention
from ._config import WorkerConfig
from ._layers import ColumnParallelLinear, RowParallelLinear
from ._rotary import inverse_frequencies
from ._tiles import BF16, DENSE, F32, Q4, Q8, TiledLinear, Tiles, dense_tiles
from .models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM

MAX_GROUP = 16  # query heads per kv head (csrc: MAX_GROUP)
# Up to this many decodes the C step beat the torch forward with C attention (oneDNN's
# linears): 16.0 / 19.7 ms at 8, 37.4 / 44.1 at 32, 63.4 / 73.1 at 64 (SmolLM2 fp32, 2 cores;
# `perf/decode_profile.py --batch B`).
MAX_BATCH = 64
# Prompts attend in C (`CpuDecode.attention`) up to this context. Each query reads its keys
# alone, so a long prompt re-reads its KV from L3 per token; torch's SDPA tiles the queries.
# One prompt of SmolLM2 fp32 (`perf/prefill_profile.py [--torch-attention]`, median ms, C /
# SDPA): 128 tokens 85.9 / 96.9, 256: 173.0 / 181.1, 512: 407.8 / 419.3, 1024: 1055.5 / 860.1.
PROMPT_CONTEXT_MAX = 512


class _Layer(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_void_p)
            for name in (
                "ln1", "ln2", "wqkv", "wo", "wgu", "wd", "bqkv", "bo", "k_cache", "v_cache"
            )
        ),
        *((name, ctypes.c_int32) for name in ("tqkv", "to", "tgu", "td")),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int32)
            for name in (
                "num_layers",
                "hidden",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "intermediate",
                "block_size",
                "cache_type",
            )
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("inv_freq", ctypes.c_void_p),
    ]


class CpuDecodeUnsupported(RuntimeError):
    """This model or setup is outside what the C decode step covers; says what."""


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@dataclass
class _LayerWeights:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Tiles
    o: Tiles
    gate_up: Tiles
    down: Tiles
    bqkv: torch.Tensor | None
    bo: torch.Tensor | None


class CpuDecode:
    """The C step over a model's weights in tiles: the tiles a GGUF model's quantized
    linears already keep (`TiledLinear`), or tiled copies of dense ones.

    Built after loading and before `pack_linears` drops the dense weights; `bind` points it
    at the KV cache (again after a sleep).
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int, max_batch: int = MAX_BATCH):
        """Raises: CpuDecodeUnsupported (what is outside the path), NativeBuildError."""
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        why = _unsupported(model, dtype)
        if why:
            raise CpuDecodeUnsupported(why)
        self.lib = _native.load("cpu_decode")
        self.lib.trillm_decode_scratch.restype = ctypes.c_int64
        self.model, self.dtype, self.max_batch = model, dtype, max_batch
        self.layers = [_layer_weights(layer) for layer in model.decoder_layers()]
        self.head = _tiles(model.lm_head.quantized_head, model.lm_head.weight)
        self.head_linear = TiledLinear(self.head, cfg.vocab_size)
        self.final_norm = model.norm.weight.data.float().contiguous()
        self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.desc = _Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            block_size,
            DENSE[dtype],
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
            self.inv_freq.data_ptr(),
        )
        self.structs: ctypes.Array[_Layer] | None = None
        self._kv: list[KVCache] | None = None
        threads = torch.get_num_threads()
        scratch = self.lib.trillm_decode_scratch(ctypes.byref(self.desc), max_batch, threads)
        self.scratch = torch.empty(int(scratch), dtype=torch.float32)
        self.hidden = torch.empty(max_batch, cfg.hidden_size, dtype=torch.float32)
        self.out = torch.empty(max_batch, cfg.hidden_size, dtype=torch.float32)
        self.threads = threads
        self.num_runs = 0  # steps run here (tests check the path was taken)
        self.num_attention_steps = 0  # torch-forward steps given C's attention (`attention`)

    def nbytes(self) -> int:
        """Bytes of the tiled weight copies (what this path costs in memory)."""
        tiles = [self.head] + [t for w in self.layers for t in (w.qkv, w.o, w.gate_up, w.down)]
        return sum(t.nbytes for t in tiles)

    def kinds(self) -> str:
        """The weight types in use, e.g. "q4, q8 head"."""
        names = {F32: "float32", BF16: "bfloat16", Q4: "q4", Q8: "q8"}
        layers = sorted(
            {names[t.kind] for w in self.layers for t in (w.qkv, w.o, w.gate_up, w.down)}
        )
        return f"{'/'.join(layers)} layers, {names[self.head.kind]} head"

    def bind(self, kv_caches: list[KVCache]) -> None:
        """Point every layer at its K and V cache tensors (held while bound: the C code has
        only their addresses)."""
        structs = (_Layer * len(self.layers))()
        for s, w, (k, v) in zip(structs, self.layers, kv_caches, strict=True):
            s.ln1, s.ln2 = w.ln1.data_ptr(), w.ln2.data_ptr()
            s.wqkv, s.wo, s.wgu, s.wd = (t.data.data_ptr() for t in (w.qkv, w.o, w.gate_up, w.down))
            s.tqkv, s.to, s.tgu, s.td = (t.kind for t in (w.qkv, w.o, w.gate_up, w.down))
            s.bqkv, s.bo = _ptr(w.bqkv), _ptr(w.bo)
            s.k_cache, s.v_cache = k.data_ptr(), v.data_ptr()
        self.structs, self._kv = structs, list(kv_caches)

    def unbind(self) -> None:
        """Let the KV cache go (sleep): no step runs here until `bind` again."""
        self.structs, self._kv = None, None

    @property
    def bound(self) -> bool:
        return self.structs is not None

    def attends(self, counts: np.ndarray, context_lens: np.ndarray) -> bool:
        """A step of sequences bringing `counts` tokens each, to `context_lens`, runs here:
        all of it (`run`) or its attention (`attention`): bound, and no prompt longer than
        `PROMPT_CONTEXT_MAX`."""
        prompts = counts > 1
        return self.bound and (
            not prompts.any() or int(context_lens[prompts].max()) <= PROMPT_CONTEXT_MAX
        )

    def covers(self, num_decodes: int) -> bool:
        """A step of this many decodes (one token per sequence) that `attends` takes runs
        here whole (`run`)."""
        return num_decodes <= self.max_batch

    def run(
        self,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        slots: np.ndarray,
        context_lens: np.ndarray,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """Final-normed hidden states [M, hidden] (model dtype) of M decode tokens, written
        into the bound KV cache. `block_table` [M, width] int32 (C order) lists each
        sequence's blocks."""
        m = len(positions)
        if m > self.hidden.shape[0]:  # the scratch was sized for the build's max_batch
            raise ValueError(f"{m} decodes, more than the {self.hidden.shape[0]} built for")
        self.num_runs += 1
        hidden = self.hidden[:m]
        hidden.copy_(self.model.embed_tokens(input_ids))
        positions = np.ascontiguousarray(positions, np.int64)
        slots = np.ascontiguousarray(slots, np.int64)
        context_lens = np.ascontiguousarray(context_lens, np.int32)
        self.lib.trillm_decode(
            ctypes.byref(self.desc),
            self.structs,
            ctypes.c_void_p(self.final_norm.data_ptr()),
            ctypes.c_void_p(hidden.data_ptr()),
            ctypes.c_void_p(self.out.data_ptr()),
            m,
            positions.ctypes.data_as(ctypes.c_void_p),
            slots.ctypes.data_as(ctypes.c_void_p),
            block_table.ctypes.data_as(ctypes.c_void_p),
            block_table.shape[1],
            context_lens.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_void_p(self.scratch.data_ptr()),
            self.threads,
        )
        return self.out[:m].to(self.dtype, copy=True)

    def attention(
        self,
        positions: np.ndarray,
        slots: np.ndarray,
        counts: np.ndarray,
        block_table: np.ndarray,
    ) -> CAttention:
        """A step the C step does not run (more decodes than `max_batch`, prompts, mixed
        steps): the torch forward with oneDNN's linears and C's attention in each layer,
        which reads the KV blocks in place where the torch path gathered them and ran SDPA.
        `positions`, `slots` per token; `counts` [B] tokens per sequence, whose blocks row b
        of `block_table` [B, width] int32 lists. At 32 decodes of SmolLM2: 44.1 ms against
        the plain torch forward's 51.4 (`perf/decode_profile.py --batch 32`); a step of 16
        prompts: perf/README.md (`prefill_profile.py --torch-attention`)."""
        self.num_attention_steps += 1
        half = self.model.config.head_dim // 2
        rotary = self.model.rotary
        index = torch.from_numpy(np.ascontiguousarray(positions, np.int64))
        prompts = bool((counts > 1).any())
        rows = np.repeat(np.arange(len(counts), dtype=np.int32), counts) if prompts else None
        return CAttention(
            self,
            rotary.cos[index][:, :half].float().contiguous(),
            rotary.sin[index][:, half:].float().contiguous(),  # the table holds -sin, sin
            np.ascontiguousarray(slots, np.int64),
            (np.asarray(positions) + 1).astype(np.int32),  # causal: up to its own position
            block_table,
            rows,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits through the tiled head (N <= max_batch),
        else the model's own head."""
        if not 0 < hidden.shape[0] <= self.max_batch:
            return self.model.compute_logits(hidden)
        logits: torch.Tensor = self.head_linear(hidden.float())
        return logits


class CAttention(QkvAttention):
    """A step's attention in C, layer by layer (`CpuDecode.attention`)."""

    def __init__(
        self,
        decode: CpuDecode,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: np.ndarray,
        context_lens: np.ndarray,
        block_table: np.ndarray,
        rows: np.ndarray | None,
    ) -> None:
        """`context_lens`, `slots` per token; `rows` [T] int32: each token's row of
        `block_table`, or None when every sequence brings one token (row t: token t)."""
        self.decode, self.cos, self.sin = decode, cos, sin
        self.slots, self.context_lens, self.block_table = slots, context_lens, block_table
        self.rows = rows
        cfg = decode.model.config
        self.out_features = cfg.num_heads * cfg.head_dim

    def attend_qkv(
        self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        x = qkv.float().contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        rows = None if self.rows is None else self.rows.ctypes.data_as(ctypes.c_void_p)
        self.decode.lib.trillm_attention(
            ctypes.byref(self.decode.desc),
            ctypes.c_void_p(k_cache.data_ptr()),
            ctypes.c_void_p(v_cache.data_ptr()),
            ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(self.cos.data_ptr()),
            ctypes.c_void_p(self.sin.data_ptr()),
            self.cos.shape[1],
            self.slots.ctypes.data_as(ctypes.c_void_p),
            self.block_table.ctypes.data_as(ctypes.c_void_p),
            self.block_table.shape[1],
            rows,
            self.context_lens.ctypes.data_as(ctypes.c_void_p),
            m,
            int(self.rows is not None),
            ctypes.c_void_p(out.data_ptr()),
            self.decode.threads,
        )
        return out.to(qkv.dtype)


def build_cpu_decode(
    model: LlamaForCausalLM, config: WorkerConfig, block_size: int
) -> tuple[CpuDecode | None, str]:
    """The C decode step for `model`, or None, and the word for `KernelChoice.decode`."""
    if config.enforce_eager:
        return None, "torch (--enforce-eager)"
    try:
        decode = CpuDecode(model, block_size, min(MAX_BATCH, config.max_num_seqs))
    except (CpuDecodeUnsupported, _native.NativeBuildError) as e:
        return None, f"torch ({e})"
    return decode, (
        f"c (one call per step of up to {decode.max_batch} decodes; {decode.kinds()}; "
        f"{decode.nbytes() / 2**20:.1f} MiB of tiled weights; other steps' attention too, "
        f"prompts up to {PROMPT_CONTEXT_MAX} tokens of context)"
    )


def _unsupported(model: LlamaForCausalLM, dtype: torch.dtype) -> str:
    """Why `model` cannot take this path, or "" when it can."""
    cfg = model.config
    if model.embed_tokens.tp.world_size != 1:
        return "tensor parallel: the C step runs one rank's whole layer"
    if dtype not in DENSE:
        return f"dtype {dtype}: float32 and bfloat16 only"
    for layer in model.decoder_layers():
        for linear in _linears(layer):
            if linear.quantized is not None and not isinstance(linear.quantized, TiledLinear):
                return "GGUF weights kept quantized for torch's int4 kernels"
            if linear.quantized is None and linear.weight.numel() == 0:
                return "the dense weights are gone (it must be built before pack_linears)"
        gate_up = layer.mlp.gate_up_proj.quantized
        if isinstance(gate_up, TiledLinear) and not gate_up.interleaved:
            return "the gate/up tiles are not interleaved"
    head = model.lm_head
    if head.quantized_head is not None and not isinstance(head.quantized_head, TiledLinear):
        return "the LM head is kept quantized for torch's kernels"
    if cfg.intermediate_size % 16:
        return f"intermediate_size {cfg.intermediate_size} is not a multiple of 16"
    if cfg.num_heads // cfg.num_kv_heads > MAX_GROUP:
        return f"more than {MAX_GROUP} query heads per kv head"
    return ""


def _linears(
    layer: LlamaDecoderLayer,
) -> tuple[ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear, RowParallelLinear]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _tiles(kept: object, weight: torch.Tensor, *, interleaved: bool = False) -> Tiles:
    """The tiles a weight kept quantized already has, or a tiled copy of the dense one."""
    if isinstance(kept, TiledLinear):
        return kept.tiles
    tiles = dense_tiles(weight.data)
    return tiles.interleaved() if interleaved else tiles


def _layer_weights(layer: LlamaDecoderLayer) -> _LayerWeights:
    qkv, o, gate_up, down = _linears(layer)
    return _LayerWeights(
        layer.input_layernorm.weight.data.float().contiguous(),
        layer.post_attention_layernorm.weight.data.float().contiguous(),
        _tiles(qkv.quantized, qkv.weight),
        _tiles(o.quantized, o.weight),
        _tiles(gate_up.quantized, gate_up.weight, interleaved=True),
        _tiles(down.quantized, down.weight),
        None if qkv.bias is None else qkv.bias.data.float().contiguous(),
        None if o.bias is None else o.bias.data.float().contiguous(),
    )
