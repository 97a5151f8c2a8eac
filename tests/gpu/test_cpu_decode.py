"""The C decode step (`_cpu_decode`, `csrc/cpu_decode.c`) against the torch forward.

Both paths run the same requests through the real runner; the C path must give the torch
path's greedy tokens and logprobs (float32: to ~1e-4; bfloat16: the C path keeps the residual
stream in float32, the torch path rounds it to bfloat16 at every add, so only closeness), take
every step it covers, leave the rest to torch, and rebind after a sleep.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trillm.default_model import default_model_dir
from trillm.gpu import SamplingOptions, Worker, WorkerConfig
from trillm.gpu.cpu import _cpu_decode, _native
from trillm.gpu.cpu._tiles import TiledLinear, dense_tiles, quantized_tiles, tile, tiled_kernels
from trillm.gpu.quant._gguf_blocks import Q4_0, Q4_1, Q8_0

from .conftest import make_runner
from .driver import Driver, DriverRequest
from .test_quantized import quantized, write_tiny_gguf

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        tiled_kernels() is None, reason="no C compiler here: the torch paths run (test_native)"
    ),
]
LOGPROBS = SamplingOptions(temperature=0.0, logprobs=3)


def _run(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    chunk: int = 1 << 30,
    stagger: int = 0,
    **kw: object,
):
    """Greedy runs with logprobs; request i arrives at step `stagger * i`, prompts prefill in
    chunks of at most `chunk` tokens."""
    runner = make_runner(model_dir, max_num_seqs=12, **kw)
    requests = [
        DriverRequest(i, p, max_tokens, LOGPROBS, arrival_step=stagger * i)
        for i, p in enumerate(prompts)
    ]
    Driver(runner, 64, chunk=chunk).run(requests)
    logprobs = [np.concatenate([o.logprobs for o in r.outputs]) for r in requests]
    return runner, [r.output for r in requests], logprobs


def _prompts(n: int) -> list[list[int]]:
    # lengths 1 (a one-token prompt is a "decode" of context 1), then across block edges
    return [list(range(100 + 13 * i, 100 + 13 * i + max(1, 7 * i))) for i in range(n)]


@pytest.mark.parametrize("num_requests", [1, 5])
def test_c_step_gives_the_torch_tokens(tiny_model_dir: Path, num_requests: int) -> None:
    prompts = _prompts(num_requests)
    eager, eager_tokens, eager_lp = _run(tiny_model_dir, prompts, 12, enforce_eager=True)
    fused, tokens, lp = _run(tiny_model_dir, prompts, 12)
    assert eager.cpu_step is None and "torch (--enforce-eager)" in eager.kernels.decode
    assert fused.cpu_step is not None and fused.kernels.decode.startswith("c (")
    assert fused.cpu_step.num_runs >= 11  # every decode step
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)


def test_bfloat16_is_close(tiny_model_dir: Path) -> None:
    prompts = _prompts(4)
    _, eager_tokens, eager_lp = _run(
        tiny_model_dir, prompts, 8, dtype="bfloat16", enforce_eager=True
    )
    fused, tokens, lp = _run(tiny_model_dir, prompts, 8, dtype="bfloat16")
    assert fused.cpu_step is not None and fused.cpu_step.num_runs >= 7
    _assert_bfloat16_close(tokens, eager_tokens, lp, eager_lp)


def _assert_bfloat16_close(tokens, eager_tokens, lp, eager_lp) -> None:  # type: ignore[no-untyped-def]
    for got, want, got_lp, want_lp in zip(tokens, eager_tokens, lp, eager_lp, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))
        assert same >= 3, (got, want)  # the prefill's token and at least two C steps agree
        np.testing.assert_allclose(got_lp[:same], want_lp[:same], atol=0.05)


@pytest.mark.parametrize(
    ("dtype", "block_size"), [("float32", 8), ("float32", 16), ("bfloat16", 16)]
)
def test_prompt_chunks_and_mixed_steps_attend_in_c(
    tiny_model_dir: Path, dtype: str, block_size: int
) -> None:
    """Prompts in chunks of 16 (a chunk attends to the chunks before it, in the cache) and
    prompts arriving while others decode (mixed steps): C's attention (`trillm_attention`,
    stores first, then attends), the torch path's tokens; blocks of 8 and of 16 (the
    server's) keys."""
    prompts = [list(range(200 + 11 * i, 200 + 11 * i + n)) for i, n in enumerate([40, 23, 9, 57])]
    kw = {"chunk": 16, "stagger": 2, "dtype": dtype, "block_size": block_size}
    runner, tokens, lp = _run(tiny_model_dir, prompts, 6, **kw)
    _, eager_tokens, eager_lp = _run(tiny_model_dir, prompts, 6, enforce_eager=True, **kw)
    assert runner.cpu_step is not None
    assert runner.cpu_step.num_attention_steps >= 8  # every step with a prompt's chunk
    assert runner.cpu_step.num_runs >= 3  # the decode-only steps at the end
    if dtype == "bfloat16":  # the prompts' tokens: later ones may part at a near tie (above)
        assert [t[0] for t in tokens] == [t[0] for t in eager_tokens]
        for a, b in zip(lp, eager_lp, strict=True):
            np.testing.assert_allclose(a[:1], b[:1], atol=0.01)  # measured: up to 0.0027
        return
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)


def test_a_prompt_past_the_c_context_bound_attends_in_torch(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a prompt longer than PROMPT_CONTEXT_MAX runs torch's SDPA (faster past it),
    its chunks up to the bound in C."""
    monkeypatch.setattr(_cpu_decode, "PROMPT_CONTEXT_MAX", 20)
    prompts = [list(range(300, 340)), list(range(400, 409))]
    runner, tokens, lp = _run(tiny_model_dir, prompts, 4)
    assert runner.cpu_step is not None
    assert runner.cpu_step.num_attention_steps == 0 and runner.cpu_step.num_runs == 3
    runner, chunked, _ = _run(tiny_model_dir, prompts, 4, chunk=16)
    assert runner.cpu_step is not None
    assert runner.cpu_step.num_attention_steps == 1  # the first chunks: contexts 16 and 9
    _, eager_tokens, eager_lp = _run(tiny_model_dir, prompts, 4, enforce_eager=True)
    assert tokens == chunked == eager_tokens
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)


def test_more_decodes_than_max_batch_run_onednn_linears_with_c_attention(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cpu_decode, "MAX_BATCH", 8)
    prompts = _prompts(10)
    runner, tokens, lp = _run(tiny_model_dir, prompts, 6)
    assert runner.cpu_step is not None and runner.cpu_step.max_batch == 8
    assert runner.cpu_step.num_runs == 0  # 10 decodes each step: above 8
    assert runner.cpu_step.num_attention_steps == 6  # the prompts' step, every decode step
    _, eager_tokens, eager_lp = _run(tiny_model_dir, prompts, 6, enforce_eager=True)
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)
    runner, tokens, lp = _run(tiny_model_dir, prompts, 6, dtype="bfloat16")  # a bfloat16 cache
    assert runner.cpu_step is not None and runner.cpu_step.num_attention_steps == 6
    eager = _run(tiny_model_dir, prompts, 6, dtype="bfloat16", enforce_eager=True)
    _assert_bfloat16_close(tokens, eager[1], lp, eager[2])


def test_sleep_and_wake_rebind_the_cache(tiny_model_dir: Path) -> None:
    prompts = _prompts(3)
    _, before, _ = _run(tiny_model_dir, prompts, 6)
    config = WorkerConfig(
        str(tiny_model_dir), device="cpu", dtype="float32", block_size=8, max_num_seqs=12
    )
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    worker.init_kv_cache(64)
    Driver(worker.runner, 64).run([DriverRequest(0, prompts[0], 3)])
    worker.sleep(1)
    assert worker.runner.cpu_step is not None and not worker.runner.cpu_step.bound
    worker.wake_up()
    requests = [DriverRequest(10 + i, p, 6, LOGPROBS) for i, p in enumerate(prompts)]
    Driver(worker.runner, 64).run(requests)
    assert [r.output for r in requests] == before


def test_tile_layout() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    tiled = tile(weight)
    assert tiled.shape == (2, 3, 16)
    assert tiled[0, 2, 5] == weight[5, 2] and tiled[1, 1, 3] == weight[19, 1]
    assert (tiled[1, :, 4:] == 0).all()  # padding rows


def test_c_linear_matches_torch() -> None:
    lib = _native.load("cpu_decode")
    for n, k, m in ((49, 33, 1), (64, 576, 3), (16, 7, 8), (40, 16, 11)):
        weight, x = torch.randn(n, k), torch.randn(m, k)
        out = torch.empty(m, n)
        w = tile(weight)
        lib.trillm_linear(
            ctypes.c_void_p(w.data_ptr()), 0, k, n, ctypes.c_void_p(x.data_ptr()), m,
            ctypes.c_void_p(out.data_ptr()), torch.get_num_threads(),
        )  # fmt: skip
        torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tile_pairs_match_torch_across_k_spans_and_token_blocks(dtype: torch.dtype) -> None:
    """A pair of tiles runs K in spans (`PAIR_KC`, 128) against blocks of 12, 8, 4, 2, 1
    tokens, at most `PAIR_TOKENS` (64) a pass, fetching into the next pair: K = 300 is two
    spans and a part, 88 rows are 3 pairs and no single tile, 5 tiles end on one; M from 4 (the
    smallest that pairs) past 64."""
    for n, k, m in ((88, 300, 13), (80, 300, 70), (88, 129, 32), (40, 256, 4), (64, 96, 7)):
        weight, x = torch.randn(n, k).to(dtype), torch.randn(m, k)
        out = TiledLinear(dense_tiles(weight), n)(x)
        torch.testing.assert_close(out, x @ weight.float().T, rtol=1e-5, atol=2e-4)


def test_default_model_greedy_tokens_match_torch() -> None:
    """SmolLM2-135M itself: the built-in model's tokens through both paths."""
    model_dir = default_model_dir(progress=False)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 30, 2], [1] * 40]
    _, eager, eager_lp = _run(model_dir, prompts, 16, enforce_eager=True, block_size=16)
    runner, tokens, lp = _run(model_dir, prompts, 16, block_size=16)
    assert runner.cpu_step is not None and runner.cpu_step.num_runs >= 15
    assert tokens == eager
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-3)


# -- GGUF weights kept quantized: the C step's Q4 / Q8 tiles ----------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("quantized") / "tiny.gguf")


def test_quantized_tiles_follow_the_dequantized_model(tiny_gguf: Path) -> None:
    """One-token prompts run wholly in C (prefill included), so against the dequantised
    model (torch, float32) only float32 rounding may differ: Q4 tiles apply d and m in
    float32 to the exact nibbles, Q8 tiles the exact int8."""
    prompts = [[5 + 11 * i] for i in range(4)]
    _, dense_tokens, dense_lp = _run(
        tiny_gguf, prompts, 10, quantization="none", enforce_eager=True
    )
    kept, tokens, lp = _run(tiny_gguf, prompts, 10, quantization="gguf")
    assert kept.cpu_step is not None and kept.cpu_step.num_runs == 10
    assert "float32/q4 layers, q8 head" in kept.kernels.decode  # layer 1's q/k/v is dense
    assert tokens == dense_tokens
    for a, b in zip(lp, dense_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_quantized_c_step_continues_the_tiled_prefill(tiny_gguf: Path) -> None:
    """The torch forward reads the same C tiles (`TiledLinear`): only float32 rounding of
    the glue around them differs."""
    prompts = _prompts(5)
    _, eager_tokens, eager_lp = _run(tiny_gguf, prompts, 8, quantization="gguf", enforce_eager=True)
    kept, tokens, lp = _run(tiny_gguf, prompts, 8, quantization="gguf")
    assert kept.cpu_step is not None and kept.cpu_step.num_runs >= 7
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_quantized_linear_matches_the_dequantized_weight(qtype: int, m: int) -> None:
    weight, _ = quantized(gguf.GGMLQuantizationType(qtype), 40, 96, seed=m)
    tiles = quantized_tiles([weight])
    x = torch.randn(m, 96)
    out = torch.empty(m, 40)
    _native.load("cpu_decode").trillm_linear(
        ctypes.c_void_p(tiles.data.data_ptr()), tiles.kind, 96, 40,
        ctypes.c_void_p(x.data_ptr()), m, ctypes.c_void_p(out.data_ptr()),
        torch.get_num_threads(),
    )  # fmt: skip
    torch.testing.assert_close(out, x @ weight.dequantize().T, rtol=1e-5, atol=1e-4)


LEVEL_CHILD = """
import sys, gguf, torch
sys.path.insert(0, sys.argv[1])
from tests.gpu.test_quantized import quantized
from trillm.gpu.quant._quantized import pack_quantized
from trillm.gpu.cpu._tiles import TiledLinear, dense_tiles
Q = gguf.GGMLQuantizationType
torch.manual_seed(0)
x = torch.randn(11, 96)
for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
    weight, _ = quantized(qtype, 40, 96)
    linear = pack_quantized([weight])
    assert isinstance(linear, TiledLinear)
    # sums of 96 products in another order (no FMA in SSE2): about 96 * 2**-24 * 10 apart
    torch.testing.assert_close(linear(x), x @ weight.dequantize().T, rtol=1e-5, atol=1e-4)
for dtype in (torch.float32, torch.bfloat16):
    w = torch.randn(40, 96).to(dtype)
    out = TiledLinear(dense_tiles(w), 40)(x)
    torch.testing.assert_close(out, x @ w.float().T, rtol=1e-5, atol=1e-4)
    w, x2 = torch.randn(88, 300).to(dtype), torch.randn(70, 300)  # K spans, token blocks
    out = TiledLinear(dense_tiles(w), 88)(x2)
    torch.testing.assert_close(out, x2 @ w.float().T, rtol=1e-5, atol=2e-4)
from pathlib import Path
from tests.gpu.conftest import make_runner, save_tiny
from tests.gpu.driver import Driver, DriverRequest
model = save_tiny(Path(sys.argv[2]) / "tiny", "qwen2")
outputs = []
for eager in (True, False):
    runner = make_runner(model, enforce_eager=eager)
    requests = [DriverRequest(i, list(range(50 + i, 60 + 3 * i)), 8) for i in range(3)]
    Driver(runner, 64).run(requests)
    outputs.append([r.output for r in requests])
assert runner.cpu_step is not None and runner.cpu_step.num_runs >= 7
assert outputs[0] == outputs[1], outputs
print("ok")
"""


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "sse2"])
@pytest.mark.slow
def test_the_avx2_and_sse2_builds_compute_the_same(march: str, tmp_path: Path) -> None:
    """Machines differ: the C code built for AVX2 (no AVX-512) and for plain x86-64 (SSE2, no
    F16C: the scalar float16 path) runs here too, and must give the same products."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 levels")
    env = {**os.environ, "TRILLM_CPU_MARCH": march, "TRILLM_CACHE_DIR": str(tmp_path)}
    root = str(Path(__file__).resolve().parents[2])
    command = [sys.executable, "-c", LEVEL_CHILD, root, str(tmp_path)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert list(tmp_path.glob("kernels/cpu_decode-*.so"))  # built for that level, apart


def test_a_head_dim_off_the_vector_width_takes_the_per_head_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """head_dim 12: not a multiple of 16, so each query head attends alone (`attend`)."""
    import shutil

    import transformers

    from .conftest import TINY

    config = transformers.LlamaConfig(**{**TINY, "hidden_size": 48}, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir(progress=False) / name, tmp_path / name)
    monkeypatch.setattr(_cpu_decode, "MAX_BATCH", 8)
    prompts = _prompts(10)
    runner, tokens, _ = _run(tmp_path, prompts, 5)
    assert runner.model_config.head_dim == 12
    # the prompts' step and every decode step (10 decodes, above 8)
    assert runner.cpu_step is not None and runner.cpu_step.num_attention_steps == 5
    _, eager_tokens, eager_lp = _run(tmp_path, prompts[:3], 5, enforce_eager=True)
    fused, small, small_lp = _run(tmp_path, prompts[:3], 5)
    assert fused.cpu_step is not None and fused.cpu_step.num_runs == 4
    assert small == eager_tokens
    for a, b in zip(small_lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)
    _, eager_tokens, _ = _run(tmp_path, prompts, 5, enforce_eager=True)
    assert tokens == eager_tokens


def test_silu_mul_in_one_pass_matches_torch() -> None:
    from trillm.gpu.cpu._cpu_ops import silu_mul

    x = torch.randn(37, 2 * 40) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert silu_mul(x.bfloat16()).dtype == torch.bfloat16  # torch's, for other dtypes
