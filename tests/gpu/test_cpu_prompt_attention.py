"""The C attention of prompt steps (`trillm_attention`, `csrc/tl_prompt_attention.h`) against
torch's SDPA (a soft-capped case: softmax written out), in float64, over odd shapes.

Prompts attend 16 tokens a block (`attend_block`), runs shorter than BLOCK_MIN and decode
tokens one by one (`attend_group`): the cases below mix both, cut prompts across the block
and the cache block sizes, read prefixes already cached, and take GQA and MHA, head dims 64
and 128, a sliding window, a soft-cap, q/k norms (per head and over the projection), rotary,
float32 and bfloat16 caches, and float32 and bfloat16 qkv and output (the bfloat16 forward's).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trillm.gpu.cpu import _native
from trillm.gpu.cpu._decode_structs import Layer, Model
from trillm.gpu.cpu._tiles import tiled_kernels

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        tiled_kernels() is None, reason="no C compiler here: the torch paths run (test_native)"
    ),
]
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    # each sequence as (tokens already cached, tokens of this step)
    seqs: tuple[tuple[int, int], ...]
    dtype: torch.dtype = torch.float32
    window: int = 0
    softcap: float = 0.0
    rotary: bool = True
    qk_norm: str = ""  # "head" or "projection"
    block_size: int = 16
    io: torch.dtype = torch.float32  # qkv's and the output's
    name: str = field(default="", compare=False)


CASES = [
    Case(9, 3, 64, ((0, 1), (0, 17), (0, 128), (0, 300)), name="gqa-lengths"),
    Case(4, 4, 128, ((0, 17), (5, 40), (200, 1), (33, 3), (0, 16)), name="mha-d128-mixed"),
    Case(9, 3, 64, ((0, 300), (70, 35), (130, 1)), window=48, name="window"),
    Case(4, 2, 64, ((0, 130), (19, 21), (7, 1)), softcap=30.0, qk_norm="head", name="cap-norm"),
    Case(9, 3, 64, ((0, 128), (31, 64), (90, 1)), dtype=torch.bfloat16, name="bf16"),
    Case(4, 4, 128, ((0, 300), (12, 2)), dtype=torch.bfloat16, window=100, name="bf16-d128"),
    Case(8, 2, 64, ((0, 45), (3, 50), (0, 4)), rotary=False, block_size=8, name="block-8"),
    Case(9, 3, 64, ((0, 128), (31, 64), (90, 1)), dtype=torch.bfloat16, io=torch.bfloat16,
         name="bf16-io"),
    Case(4, 4, 128, ((0, 300), (12, 2)), dtype=torch.bfloat16, window=100, io=torch.bfloat16,
         name="bf16-io-d128"),
    Case(4, 2, 64, ((0, 40), (9, 1), (3, 2)), dtype=torch.bfloat16, qk_norm="projection",
         io=torch.bfloat16, name="bf16-io-projection-norm"),
    Case(4, 2, 64, ((0, 40), (9, 1)), qk_norm="projection", name="projection-norm"),
    # past PAIR_KEYS (256) keys a block pairs its values a step at a time (tl_prompt_amx.h)
    Case(4, 2, 64, ((0, 300), (5, 40)), dtype=torch.bfloat16, name="bf16-long"),
    Case(4, 2, 64, ((0, 300), (270, 20)), dtype=torch.bfloat16, window=100, softcap=30.0,
         io=torch.bfloat16, name="bf16-window-cap"),
    # decode tokens over a bfloat16 cache (`tl_attend_bf16.h` where the CPU has AVX512_BF16):
    # 16 query heads a kv head (two passes of DP_HEADS), contexts across its 32-key chunks,
    # a window, blocks of 8
    Case(16, 1, 64, ((0, 1), (40, 1), (63, 1), (64, 1), (100, 1)), dtype=torch.bfloat16,
         softcap=30.0, name="bf16-decodes-group16-cap"),
    Case(4, 2, 128, ((0, 33), (31, 1), (200, 1), (95, 1)), dtype=torch.bfloat16, window=37,
         block_size=8, name="bf16-decodes-window-block8"),
]  # fmt: skip


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] by the table rows cos | cos, -sin | sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _run(case: Case, threads: int) -> None:
    torch.manual_seed(0)
    h, g, d, bs = case.heads, case.kv_heads, case.head_dim, case.block_size
    counts = [n for _, n in case.seqs]
    m = sum(counts)
    width = max(-(-(p + n) // bs) for p, n in case.seqs)
    num_blocks = width * len(case.seqs) + 3
    k_cache = torch.randn(num_blocks, bs, g, d).to(case.dtype)
    v_cache = torch.randn(num_blocks, bs, g, d).to(case.dtype)
    table = torch.randperm(num_blocks)[: width * len(case.seqs)].view(-1, width).int()
    qkv = torch.randn(m, (h + 2 * g) * d).to(case.io)
    positions = np.concatenate([np.arange(p, p + n) for p, n in case.seqs])
    rows = np.repeat(np.arange(len(case.seqs), dtype=np.int32), counts)
    slots = table[rows, positions // bs].numpy().astype(np.int64) * bs + positions % bs
    context_lens = (positions + 1).astype(np.int32)
    max_pos = int(positions.max()) + 1
    freqs = torch.rand(d // 2) + 0.01
    angles = torch.arange(max_pos)[:, None] * freqs[None]
    cos_table = torch.cat([angles.cos(), angles.cos()], -1).to(case.dtype)
    sin_table = torch.cat([-angles.sin(), angles.sin()], -1).to(case.dtype)
    whole = case.qk_norm == "projection"  # one norm over all heads' q (k)
    q_norm = torch.rand(h * d if whole else d) + 0.5
    k_norm = torch.rand(g * d if whole else d) + 0.5
    model = Model(
        num_layers=1, hidden=h * d, num_heads=h, num_kv_heads=g, head_dim=d, block_size=bs,
        cache_type=0 if case.dtype == torch.float32 else 1,
        qk_norm={"": 0, "head": 1, "projection": 2}[case.qk_norm],
        rotary_dim=d, eps=EPS, scale=d**-0.5, softcap=case.softcap, residual=1.0,
    )  # fmt: skip
    layer = Layer(
        q_norm=q_norm.data_ptr() if case.qk_norm else None,
        k_norm=k_norm.data_ptr() if case.qk_norm else None,
        rope_cos=cos_table.data_ptr() if case.rotary else None,
        rope_sin=sin_table.data_ptr() if case.rotary else None,
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), window=case.window,
    )  # fmt: skip
    out = torch.full((m, h * d), float("nan"), dtype=case.io)
    lib = tiled_kernels()
    assert lib is not None
    lib.trillm_attention(
        ctypes.byref(model), ctypes.byref(layer),
        ctypes.c_void_p(k_cache.data_ptr()), ctypes.c_void_p(v_cache.data_ptr()),
        ctypes.c_void_p(qkv.data_ptr()),
        positions.astype(np.int64).ctypes.data_as(ctypes.c_void_p),
        slots.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_void_p(table.data_ptr()), width,
        rows.ctypes.data_as(ctypes.c_void_p), context_lens.ctypes.data_as(ctypes.c_void_p),
        m, 1, ctypes.c_void_p(out.data_ptr()), threads, int(case.io == torch.bfloat16),
    )  # fmt: skip

    q, k, v = qkv.double().split([h * d, g * d, g * d], dim=-1)
    q, k, v = q.view(m, h, d), k.view(m, g, d), v.view(m, g, d)
    if whole:
        q = _norm(q.reshape(m, h * d), q_norm.double()).view(m, h, d)
        k = _norm(k.reshape(m, g * d), k_norm.double()).view(m, g, d)
    elif case.qk_norm:
        q, k = _norm(q, q_norm.double()), _norm(k, k_norm.double())
    if case.rotary:
        cos, sin = cos_table.double()[positions], sin_table.double()[positions]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    flat_k = k_cache.view(-1, g, d).double()
    flat_v = v_cache.view(-1, g, d).double()
    stored_tol = 1e-6 if case.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(flat_k[slots], k, atol=stored_tol, rtol=stored_tol)
    torch.testing.assert_close(flat_v[slots], v, atol=stored_tol, rtol=stored_tol)

    start = 0
    for s, (prefix, n) in enumerate(case.seqs):
        ctx = prefix + n
        key_slots = table[s, torch.arange(ctx) // bs].long() * bs + torch.arange(ctx) % bs
        keys = flat_k[key_slots].repeat_interleave(h // g, dim=1).transpose(0, 1)
        values = flat_v[key_slots].repeat_interleave(h // g, dim=1).transpose(0, 1)
        pos = torch.arange(prefix, ctx)[:, None]
        j = torch.arange(ctx)[None]
        allowed = (j <= pos) & ((j > pos - case.window) if case.window else True)
        queries = q[start : start + n].transpose(0, 1)  # [h, n, d]
        if case.softcap:
            scores = queries @ keys.transpose(1, 2) * model.scale
            scores = case.softcap * torch.tanh(scores / case.softcap)
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            expect = weights @ values
        else:
            expect = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=allowed, scale=model.scale
            )
        got = out[start : start + n].view(n, h, d).transpose(0, 1).double()
        # bfloat16: rounded q and softmax weights (`tl_attend_bf16.h`), or without AVX512_BF16
        # a token's own key unrounded
        tol = 2e-5 if case.dtype == case.io == torch.float32 else 2e-2
        torch.testing.assert_close(got, expect, atol=tol, rtol=tol, msg=f"{case.name} seq {s}")
        start += n


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_attention_matches_sdpa(case: Case, threads: int) -> None:
    _run(case, threads)


LEVEL_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.gpu import test_cpu_prompt_attention as t
for case in t.CASES:
    t._run(case, 2)
print("ok")
"""


@pytest.mark.parametrize(
    "march", ["icelake-server", "x86-64-v3", "x86-64"], ids=["avx512-without-amx", "avx2", "sse2"]
)
@pytest.mark.slow
def test_the_builds_without_amx_attend_prompts_the_same(march: str, tmp_path: Path) -> None:
    """The kernel built without AMX (a bfloat16 cache's blocks in float32 FMAs, not on tiles:
    `tl_prompt_amx.h`) and without AVX-512 (fewer score accumulators and value dims a pass)."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 levels")
    if march == "icelake-server" and "avx512f" not in _native._cpu_flags().split():
        pytest.skip("this CPU cannot run AVX-512 code")
    env = {**os.environ, "TRILLM_CPU_MARCH": march, "TRILLM_CACHE_DIR": str(tmp_path)}
    root = str(Path(__file__).resolve().parents[2])
    command = [sys.executable, "-c", LEVEL_CHILD, root]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert list(tmp_path.glob("kernels/cpu_decode-*.so"))
