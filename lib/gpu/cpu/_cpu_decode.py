"""The CPU step in C (`CpuStep`, `csrc/cpu_decode.c`): the CPU's answer to CUDA graphs.

A decode step runs in one C call; the steps it does not cover attend in C inside the torch
forward; the logits go through the tiled head.

Why: a batch-1 decode step of SmolLM2-135M in float32 must read 538 MB of weights. On the
2-core AVX-512 CI machine the torch forward issued 4,972 torch ops a step (norms, rotary,
gathers, SDPA, views, and the 121 linears, each its own OpenMP region) and took 15.75 ms;
this step takes 8.24 ms, reading the weights at 65 GB/s (`perf/decode_profile.py`, both
interleaved in one run). Here every decoder layer runs inside one OpenMP region, over
weights laid out for a matrix-vector product (16-row tiles, k-major), with the KV write and
paged attention in the same pass.

What it covers: steps in which every sequence brings one token (decodes, and one-token
prompts) and there are at most `max_batch` (64) of them, of the sizes where it beat the torch
forward on this machine (`paths`: measured at start-up by `_decode_probe`, or forced by
`--cpu-decode`), on one rank, in float32 or bfloat16,
dense or GGUF weights kept quantized (the same C tiles, `_tiles`), of every family in
`models/`: what a family adds (q/k norms, sandwich or output norms, GeGLU, soft-caps,
windows, partial or per-layer rotary, longrope, multipliers, experts) is told to C as an
operation (`_cpu_decode_model`). Other steps (larger decode steps, prompts, mixed steps) run
the torch forward, whose dense linears stay packed for oneDNN or, where measured faster at
load, multiply from these tiles (`_prompt_linears`: then the dense copy is dropped), with C's
attention (`attention`, the same q/k norms, rotary, windows and soft-caps) unless a
prompt's context passes `PROMPT_CONTEXT_MAX`; tensor parallel runs the torch forward alone.
The price, for dense weights kept on oneDNN, is a second copy in the tiled layout (logged at
load): dense experts too, which the torch forward still multiplies from `FusedMoE.w13` / `w2`.
`--enforce-eager` turns it off, as it turns CUDA graphs off.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ...common.config import WorkerConfig
from ..attention._attention import QkvAttention
from ..models.llama import KVCache, LlamaForCausalLM
from . import _native
from ._cpu_decode_model import CpuDecodeUnsupported as CpuDecodeUnsupported
from ._cpu_decode_model import layer_weights, model_struct, unsupported
from ._decode_paths import C_STEP, TORCH, DecodePaths
from ._decode_structs import Layer
from ._tiles import (
    BF16,
    BF16_AMX,
    F32,
    Q4,
    Q8,
    TiledLinear,
    Tiles,
    pair_products,
    pairs_ready,
    weight_tiles,
)

# The most decodes a C step takes (its scratch is sized for them). Up to this many the C step
# beat the torch forward with C attention (oneDNN's linears) on the AVX-512 machine: 16.0 /
# 19.7 ms at 8, 37.4 / 44.1 at 32, 63.4 / 73.1 at 64 (SmolLM2 fp32, 2 cores;
# `perf/decode_profile.py --batch B`); where it does not, the measurement (`paths`) says so.
MAX_BATCH = 64
# Prompts attend in C (`CpuStep.attention`) up to this context; past it torch's SDPA takes the
# step. C's attention takes a prompt 16 queries at a time (`csrc/tl_prompt_attention.h`); one
# layer's attention alone against SDPA alone (1 thread, CPU time, ms, C / SDPA; SmolLM2's
# shape): 512 tokens 4.58 / 10.44, 1024: 14.9 / 21.6, 2048: 57.6 / 61.8, 4096: 237 / 214; a
# 2048-token prefill step 9525 / 11422 ms, 2 threads on a loaded machine
# (`perf/prompt_attention_bench.py --step --prompts 1 --prompt-len 2048 --sdpa`).
PROMPT_CONTEXT_MAX = 2048


class CpuStep:
    """Whole CPU steps in C over a model's weights in tiles: decode steps in one call
    (`run`), the attention of the steps the torch forward runs (`attention`) and the logits
    (`compute_logits`). The tiles are those a GGUF model's quantized linears already keep
    (`TiledLinear`), or tiled copies of dense ones.

    Built after loading and before `pack_linears` drops the dense weights; `bind` points it
    at the KV cache (again after a sleep).
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int, max_batch: int = MAX_BATCH):
        """Raises: CpuDecodeUnsupported (what is outside the path), NativeBuildError."""
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        why = unsupported(model, dtype)
        if why:
            raise CpuDecodeUnsupported(why)
        self.lib = _native.load("cpu_decode")
        self.lib.trillm_decode_scratch.restype = ctypes.c_int64
        self.model, self.dtype, self.max_batch = model, dtype, max_batch
        amx = dtype == torch.bfloat16 and pairs_ready()
        self.layers = [layer_weights(layer, amx) for layer in model.decoder_layers()]
        self.head = _head_tiles(model, amx)
        self.head_linear = TiledLinear(self.head, cfg.vocab_size)
        self.final_norm = model.norm.scale().contiguous()
        self.desc = model_struct(model, block_size)
        self.structs: ctypes.Array[Layer] | None = None
        self._kv: list[KVCache] | None = None
        self._layer_of: dict[int, int] = {}  # a bound K cache's address -> its layer
        self._ones = np.ones(max_batch, np.int32)  # a decode step's tokens per sequence
        threads = torch.get_num_threads()
        scratch = self.lib.trillm_decode_scratch(ctypes.byref(self.desc), max_batch, threads)
        self.scratch = torch.empty(int(scratch), dtype=torch.float32)
        self.hidden = torch.empty(max_batch, cfg.hidden_size, dtype=torch.float32)
        self.out = torch.empty(max_batch, cfg.hidden_size, dtype=torch.float32)
        self.threads = threads
        self.paths: DecodePaths = C_STEP  # which decode steps run here (`covers`)
        self.num_runs = 0  # steps run here (tests check the path was taken)
        self.num_lora_runs = 0  # of them, steps with LoRA adapter rows
        self.num_attention_steps = 0  # torch-forward steps given C's attention (`attention`)

    def nbytes(self) -> int:
        """Bytes of the tiled weight copies (what this path costs in memory)."""
        return sum(t.nbytes for t in self._all_tiles())

    def kinds(self) -> str:
        """The weight types in use, e.g. "q4, q8 head"."""
        amx = f"bfloat16 AMX ({pair_products()})"
        names = {F32: "float32", BF16: "bfloat16", Q4: "q4", Q8: "q8", BF16_AMX: amx}
        layers = sorted({names[t.kind] for w in self.layers for t in w.tiles()})
        return f"{'/'.join(layers)} layers, {names[self.head.kind]} head"

    def operations(self) -> str:
        """What of the model's architecture the C step runs beyond Llama's ("" for Llama)."""
        d, cfg = self.desc, self.model.config
        inputs = all(w.norms[0] is not None for w in self.layers)  # ln1
        outputs = all(w.norms[2] is not None for w in self.layers)  # ln_attn_out
        ops = [
            (d.qk_norm == 1, "q/k norms per head"),
            (d.qk_norm == 2, "q/k norms over the projection"),
            (inputs and outputs, "sandwich norms"),
            (not inputs and outputs, "output norms only"),
            (cfg.norm_offset != 0.0, "(offset + weight) norms"),
            (d.act == 1, "GeGLU"),
            (d.softcap > 0.0, f"scores soft-capped at {d.softcap:g}"),
            (any(w.window for w in self.layers), "sliding windows"),
            (any(w.rope is None for w in self.layers), "layers without rotary"),
            (d.rotary_dim != d.head_dim, f"rotary over {d.rotary_dim} of {d.head_dim} dims"),
            (d.residual != 1.0, f"residual multiplier {d.residual:g}"),
            (d.num_experts > 0, f"top {d.top_k} of {d.num_experts} experts"),
        ]
        return ", ".join(what for on, what in ops if on)

    def _all_tiles(self) -> list[Tiles]:
        return [self.head] + [t for w in self.layers for t in w.tiles()]

    def bind(self, kv_caches: list[KVCache]) -> None:
        """Point every layer at its K and V cache tensors (held while bound: the C code has
        only their addresses)."""
        structs = (Layer * len(self.layers))()
        for s, w, (k, v) in zip(structs, self.layers, kv_caches, strict=True):
            w.fill(s)
            s.k_cache, s.v_cache = k.data_ptr(), v.data_ptr()
        self.structs, self._kv = structs, list(kv_caches)
        self._layer_of = {k.data_ptr(): i for i, (k, _) in enumerate(kv_caches)}

    def unbind(self) -> None:
        """Let the KV cache go (sleep): no step runs here until `bind` again."""
        self.structs, self._kv, self._layer_of = None, None, {}

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
        here whole (`run`): at most `max_batch`, at a size where `paths` gives it the C step."""
        return num_decodes <= self.max_batch and self.paths.takes_c_step(num_decodes)

    def describe(self) -> str:
        """The word for `KernelChoice.decode`: which decode steps run here (`paths`), the
        tiles and what they cost, what of the family C runs."""
        ops = self.operations()
        torch_only = self.paths.forced == "torch"
        attention = "every step's attention in C" if torch_only else "other steps' attention too"
        return (
            f"{self.paths.describe(self.max_batch)}; {self.kinds()}; "
            f"{self.nbytes() / 2**20:.1f} MiB of tiled weights; "
            + (f"{self.model.config.model_type}'s {ops}; " if ops else "")
            + f"{attention}, prompts up to {PROMPT_CONTEXT_MAX} tokens of context)"
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        slots: np.ndarray,
        context_lens: np.ndarray,
        block_table: np.ndarray,
        *,
        store_first: bool = False,
        lora_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [M, hidden] (model dtype) of M decode tokens, written
        into the bound KV cache. `block_table` [M, width] int32 (C order) lists each
        sequence's blocks. `store_first`: rows share blocks and read each other's new K/V (a
        speculative verify step, one row per token: `expand_verify_rows`). `lora_slots` [M]
        int32: each token's LoRA slot, -1 for the base model (None: no adapter in the step;
        `LoraBatch.token_slots`)."""
        m = len(positions)
        if m > self.hidden.shape[0]:  # the scratch was sized for the build's max_batch
            raise ValueError(f"{m} decodes, more than the {self.hidden.shape[0]} built for")
        if lora_slots is not None and (self.desc.lora_rank == 0 or len(lora_slots) != m):
            raise ValueError(
                f"LoRA slots for {len(lora_slots)} tokens of {m}, on a C step built "
                f"{'with' if self.desc.lora_rank else 'without'} LoRA (--enable-lora)"
            )
        self.num_runs += 1
        self.num_lora_runs += lora_slots is not None
        embeds = self.model.embed_tokens(input_ids)
        multiplier = self.model.config.embedding_multiplier
        if multiplier != 1.0:  # in the model's dtype, as the torch forward scales it
            embeds = embeds * multiplier
        hidden = self.hidden[:m]
        hidden.copy_(embeds)
        rows = self.model.rotary.rope_positions(positions, self._ones[:m], context_lens)
        rows = np.ascontiguousarray(rows, np.int64)
        slots = np.ascontiguousarray(slots, np.int64)
        context_lens = np.ascontiguousarray(context_lens, np.int32)
        lora = None if lora_slots is None else np.ascontiguousarray(lora_slots, np.int32)
        self.lib.trillm_decode(
            ctypes.byref(self.desc),
            self.structs,
            ctypes.c_void_p(self.final_norm.data_ptr()),
            ctypes.c_void_p(hidden.data_ptr()),
            ctypes.c_void_p(self.out.data_ptr()),
            m,
            rows.ctypes.data_as(ctypes.c_void_p),
            slots.ctypes.data_as(ctypes.c_void_p),
            block_table.ctypes.data_as(ctypes.c_void_p),
            block_table.shape[1],
            context_lens.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_void_p(self.scratch.data_ptr()),
            self.threads,
            int(store_first),
            None if lora is None else lora.ctypes.data_as(ctypes.c_void_p),
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
        positions = np.asarray(positions)
        prompts = bool((counts > 1).any())
        rows = np.repeat(np.arange(len(counts), dtype=np.int32), counts) if prompts else None
        context_lens = positions[np.cumsum(counts) - 1] + 1  # each sequence's, after this step
        rope_rows = self.model.rotary.rope_positions(positions, counts, context_lens)
        return CAttention(
            self,
            np.ascontiguousarray(rope_rows, np.int64),
            np.ascontiguousarray(slots, np.int64),
            (positions + 1).astype(np.int32),  # causal: up to its own position
            block_table,
            rows,
        )

    def layer_struct(self, k_cache: torch.Tensor) -> ctypes._CArgObject:
        """The bound `tl_layer` whose K cache `k_cache` is (a pointer for ctypes)."""
        if self.structs is None:
            raise RuntimeError("the C step is not bound to a KV cache (bind first)")
        layer = self._layer_of[k_cache.data_ptr()]
        return ctypes.byref(self.structs, layer * ctypes.sizeof(Layer))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits through the tiled head (N <= max_batch),
        else the model's own head."""
        if not 0 < hidden.shape[0] <= self.max_batch:
            return self.model.compute_logits(hidden)
        logits: torch.Tensor = self.head_linear(hidden.float())
        return self.model.finish_logits(logits)


class CAttention(QkvAttention):
    """A step's attention in C, layer by layer (`CpuStep.attention`): the layer's q/k norms,
    rotary table and window, the model's scale and soft-cap, as in the C step."""

    native_bf16 = True  # bfloat16 qkv and output as they are (False: converted, for A/B)

    def __init__(
        self,
        decode: CpuStep,
        rope_rows: np.ndarray,
        slots: np.ndarray,
        context_lens: np.ndarray,
        block_table: np.ndarray,
        rows: np.ndarray | None,
    ) -> None:
        """`rope_rows` (int64: each token's row of the rotary tables), `context_lens`,
        `slots` per token; `rows` [T] int32: each token's row of `block_table`, or None when
        every sequence brings one token (row t: token t)."""
        self.decode, self.rope_rows = decode, rope_rows
        self.slots, self.context_lens, self.block_table = slots, context_lens, block_table
        self.rows = rows
        cfg = decode.model.config
        self.out_features = cfg.num_heads * cfg.head_dim

    def attend_qkv(
        self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """The layer's attention output [T, heads * head_dim], in qkv's dtype. bfloat16 goes
        to C as it is (converted a head at a time there): converting the whole [T, q + 2 kv]
        to float32 and the output back were two more passes and parallel regions a layer; a
        16 x 128 bfloat16 prefill step took 998 against 1111 ms of CPU time on one thread
        (`perf/prefill_profile.py --dtype bfloat16 --prompts 16 --ab-attention-io --threads 1
        --cpu-time`, 9 pairs alternated)."""
        native = self.native_bf16 and qkv.dtype == torch.bfloat16
        x = (qkv if native else qkv.float()).contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=x.dtype)
        rows = None if self.rows is None else self.rows.ctypes.data_as(ctypes.c_void_p)
        self.decode.lib.trillm_attention(
            ctypes.byref(self.decode.desc),
            self.decode.layer_struct(k_cache),
            ctypes.c_void_p(k_cache.data_ptr()),
            ctypes.c_void_p(v_cache.data_ptr()),
            ctypes.c_void_p(x.data_ptr()),
            self.rope_rows.ctypes.data_as(ctypes.c_void_p),
            self.slots.ctypes.data_as(ctypes.c_void_p),
            self.block_table.ctypes.data_as(ctypes.c_void_p),
            self.block_table.shape[1],
            rows,
            self.context_lens.ctypes.data_as(ctypes.c_void_p),
            m,
            int(self.rows is not None),
            ctypes.c_void_p(out.data_ptr()),
            self.decode.threads,
            BF16 if native else F32,
        )
        return out if native else out.to(qkv.dtype)


def build_cpu_step(
    model: LlamaForCausalLM, config: WorkerConfig, block_size: int
) -> tuple[CpuStep | None, str]:
    """The C step for `model`, or None, and the word for `KernelChoice.decode`: the path
    this model's decode steps take, and why (what of the family C runs, or lacks). Under
    `cpu_decode="auto"` its `paths` are `C_STEP` until `_decode_probe` measures them."""
    if config.enforce_eager:
        return None, "torch (--enforce-eager)"
    try:
        decode = CpuStep(model, block_size, min(MAX_BATCH, config.max_num_seqs))
    except (CpuDecodeUnsupported, _native.NativeBuildError) as e:
        return None, f"torch ({e})"
    decode.paths = TORCH if config.cpu_decode == "torch" else C_STEP
    return decode, decode.describe()


def _head_tiles(model: LlamaForCausalLM, amx: bool) -> Tiles:
    """The LM head's tiles: a GGUF head's own, or a tiled copy of the dense matrix."""
    kept = model.lm_head.quantized_head
    if isinstance(kept, TiledLinear):
        return kept.tiles
    return weight_tiles(model.lm_head.weight.data, amx)
