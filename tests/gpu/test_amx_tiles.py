"""bfloat16 products on AMX tiles (`csrc/tl_amx.h`, `_tiles.amx_tiles`).

The oracle is torch's product of the same bfloat16 weights with the activations rounded to
bfloat16 (what the tile unit multiplies, summed in float32). On a CPU or build without AMX the
same layout is read by AVX512_BF16's `vdpbf16ps` (AMD Zen 4) or, without it, by plain C, so
the layout is checked everywhere; `_tiles.pair_products` says which ran. The C step with AMX
tiles is checked against the torch forward in test_cpu_decode*.py (its bfloat16 tests take
them where `pairs_ready`); here it is checked against its own FMA tiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trillm.gpu.cpu import _tiles
from trillm.gpu.cpu._tiles import BF16_AMX, TiledLinear, amx_tiles, tiled_kernels, weight_tiles

from .conftest import make_runner
from .driver import Driver, DriverRequest
from .test_cpu_decode import LOGPROBS, _assert_bfloat16_close

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        tiled_kernels() is None, reason="no C compiler here: the torch paths run (test_native)"
    ),
]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float() @ w.float().T


@pytest.mark.parametrize(
    ("n", "k", "m"),
    [(16, 32, 1), (40, 64, 15), (40, 64, 16), (96, 576, 17), (50, 96, 33), (48, 64, 70)],
)
def test_amx_tiles_give_torch_products_of_bfloat16_tokens(n: int, k: int, m: int) -> None:
    """Odd row counts (a last tile part padding), token counts across the 16-row tiles and
    32-token blocks, one and several k chunks."""
    torch.manual_seed(n * k + m)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k)
    tiles = amx_tiles(w)
    assert tiles.kind == BF16_AMX and tiles.data.shape == (-(-n // 16), k * 16)
    torch.testing.assert_close(TiledLinear(tiles, n)(x), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_interleaved_amx_tiles_come_back_in_gate_up_order() -> None:
    torch.manual_seed(1)
    w, x = torch.randn(64, 64).bfloat16(), torch.randn(5, 64)
    out = TiledLinear(amx_tiles(w), 64, interleaved=True)(x)
    torch.testing.assert_close(out, _reference(x, w), rtol=1e-5, atol=1e-4)


def test_weights_off_the_chunk_width_keep_fma_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """K % 32 != 0 (the tile unit's 32-k chunk), float32, or AMX turned off: `TL_BF16` /
    `TL_F32` tiles."""
    assert weight_tiles(torch.zeros(16, 48, dtype=torch.bfloat16), amx=True).kind == _tiles.BF16
    assert weight_tiles(torch.zeros(16, 64), amx=True).kind == _tiles.F32
    assert weight_tiles(torch.zeros(16, 64, dtype=torch.bfloat16), amx=True).kind == BF16_AMX
    assert weight_tiles(torch.zeros(16, 64, dtype=torch.bfloat16), amx=False).kind == _tiles.BF16
    monkeypatch.setattr(_tiles, "AMX_ENABLED", False)
    assert not _tiles.amx_ready()


def _greedy(model_dir: Path, amx: bool, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_tiles, "AMX_ENABLED", amx)
    runner = make_runner(model_dir, max_num_seqs=40, dtype="bfloat16", num_blocks=256)
    prompts = [list(range(100 + 7 * i, 110 + 9 * i)) for i in range(36)]  # 36: two 32-row blocks
    requests = [DriverRequest(i, p, 6, LOGPROBS) for i, p in enumerate(prompts)]
    Driver(runner, 256).run(requests)
    logprobs = [np.concatenate([o.logprobs for o in r.outputs]) for r in requests]
    return runner, [r.output for r in requests], logprobs


def test_the_c_step_on_amx_tiles_is_close_to_its_fma_tiles(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """36 decodes a step (the C step's AMX blocks of 32 tokens and a part block). The FMA
    tiles multiply float32 activations, the tile unit their bfloat16 rounding: close, not
    equal."""
    if not _tiles.pairs_ready():
        pytest.skip("no AMX or vdpbf16ps products here (pairs_ready): the C step keeps FMA tiles")
    amx, tokens, lp = _greedy(tiny_model_dir, True, monkeypatch)
    fma, fma_tokens, fma_lp = _greedy(tiny_model_dir, False, monkeypatch)
    assert amx.cpu_step is not None and fma.cpu_step is not None
    kind = f"bfloat16 AMX ({_tiles.pair_products()})"
    assert f"{kind} layers, {kind} head" in amx.cpu_step.kinds()
    assert "AMX" not in fma.cpu_step.kinds()
    assert amx.cpu_step.num_runs >= 5 and fma.cpu_step.num_runs >= 5  # every decode step
    _assert_bfloat16_close(tokens, fma_tokens, lp, fma_lp)


LAYOUT_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from trillm.gpu.cpu._tiles import TiledLinear, amx_ready, amx_tiles, pair_products, pairs_ready
assert not amx_ready()  # this build has no AMX nor AVX512_BF16: plain C reads the layout
assert not pairs_ready() and pair_products() == ""
torch.manual_seed(0)
for n, k, m in ((40, 64, 3), (96, 576, 33)):
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k)
    want = x.bfloat16().float() @ w.float().T
    torch.testing.assert_close(TiledLinear(amx_tiles(w), n)(x), want, rtol=1e-5, atol=1e-4)
print("ok")
"""


@pytest.mark.slow
def test_a_build_without_amx_reads_the_layout_in_plain_c(tmp_path: Path) -> None:
    """Machines differ: an AVX2 build (no AMX, no `vdpbf16ps`) computes the same products
    from AMX tiles."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 levels")
    env = {**os.environ, "TRILLM_CPU_MARCH": "x86-64-v3", "TRILLM_CACHE_DIR": str(tmp_path)}
    root = str(Path(__file__).resolve().parents[2])
    command = [sys.executable, "-c", LAYOUT_CHILD, root]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
