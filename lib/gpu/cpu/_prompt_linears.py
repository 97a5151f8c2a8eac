"""The torch forward's dense linears on the C step's tiles, where they beat torch's on this CPU.

A dense model on the CPU keeps two copies of every linear weight: oneDNN's packed one (or the
plain weight for F.linear, where oneDNN cannot pack the dtype) for the torch forward (prompts,
mixed steps) and the C step's tiles (decode steps). Which multiplies a prompt faster depends
on the machine: on the 2-core AVX-512 machines oneDNN's GEMM was better at prompt sizes, but
on an AVX2-only Zen 2 the tiles' 6-token blocks (`csrc/tl_narrow.h`) ran
SmolLM2's 120 float32 linears at 512 tokens in 600 ms against oneDNN's 742, at 2048 in 2481
against 2895 (`perf/linear_bench.py --tiled`), and bfloat16 there has no oneDNN at all (F.linear
at 15 GFLOP/s: `_cpu_linear.BF16_WITHOUT_HARDWARE`). So it is measured at start-up
(`measure_prompt_linears`: one layer's four linears at `PROMPT_TOKENS` tokens each way, the
fastest of `RUNS`), and where the tiles win by `_decode_paths.MARGIN`, every decoder layer's
linears multiply from them (`use_tiles`: `TiledLinear`, the form GGUF weights kept quantized
already take) and torch's copies are dropped: the model keeps one copy of its weights.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..layers._layers import ColumnParallelLinear, RowParallelLinear
from ._cpu_linear import packed_linear
from ._decode_paths import PromptTiming
from ._tiles import BF16, F32, TiledLinear

if TYPE_CHECKING:
    from ..models.llama import LlamaForCausalLM
    from ._cpu_decode import CpuStep

PROMPT_TOKENS = 512  # tokens of the measured products: a prompt chunk
RUNS = 3  # timed runs each way, after a warm-up; the fastest counts

Linear = ColumnParallelLinear | RowParallelLinear


def tiled_linears(step: CpuStep, model: LlamaForCausalLM) -> list[list[tuple[Linear, TiledLinear]]]:
    """Every decoder layer's dense linears (qkv, o, gate/up, down), each with a `TiledLinear`
    over the C step's tiles of it; empty where some layer has none to offer (experts, weights
    kept quantized, AMX tiles, or no torch copy left to compare with)."""
    cfg = model.config
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    rows: list[list[tuple[Linear, TiledLinear]]] = []
    for layer, weights in zip(model.decoder_layers(), step.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if weights.gate_up is None or weights.down is None or gate_up is None or down is None:
            return []
        parts = [
            (attn.qkv_proj, weights.qkv, qkv, False),
            (attn.o_proj, weights.o, cfg.hidden_size, False),
            (gate_up, weights.gate_up, 2 * cfg.intermediate_size, True),
            (down, weights.down, cfg.hidden_size, False),
        ]
        row: list[tuple[Linear, TiledLinear]] = []
        for linear, tiles, n, interleaved in parts:
            if (
                linear.packed is None
                or linear.quantized is not None
                or tiles.kind not in (F32, BF16)
            ):
                return []
            row.append((linear, TiledLinear.over(tiles, n, interleaved=interleaved)))
        rows.append(row)
    return rows


def measure_prompt_linears(
    layer: list[tuple[Linear, TiledLinear]], dtype: torch.dtype, tokens: int = PROMPT_TOKENS
) -> PromptTiming:
    """One layer's linears at `tokens` tokens, as the torch forward runs them (oneDNN's packed
    copies, else F.linear) and on the tiles, alternated, the fastest of `RUNS` each (other work
    on the cores only adds time)."""
    generator = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(tokens, tiled.tiles.data.shape[1] // 16, generator=generator).to(dtype)
        for _, tiled in layer
    ]

    def in_torch() -> float:
        start = time.perf_counter()
        for (linear, _), x in zip(layer, inputs, strict=True):
            if linear.packed is not None:
                packed_linear(x, linear.packed, None)
            else:
                F.linear(x, linear.weight)
        return time.perf_counter() - start

    def tiles() -> float:
        start = time.perf_counter()
        for (_, tiled), x in zip(layer, inputs, strict=True):
            tiled(x)
        return time.perf_counter() - start

    in_torch(), tiles()  # warm-ups
    times = [(in_torch(), tiles()) for _ in range(RUNS)]
    return PromptTiming(tokens, min(t for _, t in times) * 1e3, min(o for o, _ in times) * 1e3)


def use_tiles(rows: list[list[tuple[Linear, TiledLinear]]]) -> None:
    """Every linear of `rows` multiplies from its tiles, and torch's copy is let go."""
    for row in rows:
        for linear, tiled in row:
            linear.quantized, linear.packed = tiled, None
            linear.weight.data = torch.empty(0, dtype=linear.weight.dtype)
