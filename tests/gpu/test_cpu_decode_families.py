"""The C decode step over every model family (`_cpu_decode_model`) against the torch forward
and transformers.

The models are `families.py`'s tiny seeded ones, in which what each family adds matters
(windows shorter than the prompts, soft-caps that bite, multipliers, q/k norms, partial rotary
with longrope, experts). Each runs through the real runner twice, with the C step and with
`enforce_eager` (the torch forward alone): greedy tokens equal, logprobs to float32 rounding,
and transformers' greedy tokens. Prompts arrive one a step in chunks of 16, so the prompts'
steps run C's attention inside the torch forward (`CAttention`) and the decode-only steps the
C step whole; both counters prove it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from trillm.gpu import ModelRunner, SamplingOptions, TensorParallel, WorkerConfig, open_model
from trillm.gpu.cpu import _native
from trillm.gpu.cpu._cpu_decode import build_cpu_step
from trillm.gpu.cpu._tiles import Q4, Q8, pair_products, pairs_ready, tiled_kernels
from trillm.gpu.models import family_for
from trillm.gpu.quant._gguf_blocks import BLOCK_BYTES, QuantizedTensor

from . import families
from .conftest import make_runner
from .driver import Driver, DriverRequest

pytestmark = pytest.mark.timeout(300)
NEEDS_C = pytest.mark.skipif(
    tiled_kernels() is None, reason="no C compiler here: the torch paths run (test_native)"
)
LOGPROBS = SamplingOptions(temperature=0.0, logprobs=3)
PROMPTS = [list(range(50, 50 + n)) for n in (3, 17, 9, 30)]  # past every family's window
MAX_TOKENS = 8
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", params=families.DENSE + families.MOE)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return families.save(request.param, tmp_path_factory.mktemp(request.param))


def _run(
    model_dir: Path | ModelRunner,
    prompts: list[list[int]],
    max_tokens: int = MAX_TOKENS,
    **kw: object,
) -> tuple[ModelRunner, list[list[int]], list[np.ndarray]]:
    """Greedy runs with logprobs, request i arriving at step i, prompts in chunks of 16."""
    runner = (
        model_dir
        if isinstance(model_dir, ModelRunner)
        else make_runner(model_dir, max_num_seqs=12, **kw)
    )
    requests = [
        DriverRequest(i, p, max_tokens, LOGPROBS, arrival_step=i) for i, p in enumerate(prompts)
    ]
    Driver(runner, 64, chunk=16).run(requests)
    logprobs = [np.concatenate([o.logprobs for o in r.outputs]) for r in requests]
    return runner, [r.output for r in requests], logprobs


def _assert_same(lp: list[np.ndarray], eager_lp: list[np.ndarray], atol: float = 1e-4) -> None:
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=atol)


def _reference(model_dir: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.config.model_type == "gemma2":
        model.config._attn_implementation = "eager"  # transformers' SDPA has no soft-cap
    return model.eval()


@NEEDS_C
def test_the_c_step_gives_the_torch_paths_tokens_and_logprobs(family_dir: Path) -> None:
    eager, eager_tokens, eager_lp = _run(family_dir, PROMPTS, enforce_eager=True)
    fused, tokens, lp = _run(family_dir, PROMPTS)
    assert eager.cpu_step is None
    decode = fused.cpu_step
    assert decode is not None and fused.kernels is not None
    assert fused.kernels.decode.startswith("c ("), fused.kernels.decode
    assert f"{fused.model_config.model_type}'s " in fused.kernels.decode  # what C runs of it
    assert decode.num_runs >= MAX_TOKENS - 4  # the decode-only steps once all prompts are in
    assert decode.num_attention_steps >= 4  # every step with a prompt's chunk
    assert tokens == eager_tokens
    _assert_same(lp, eager_lp)
    hf = _reference(family_dir)
    assert tokens == [families.greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@NEEDS_C
def test_a_sliding_layer_never_reads_the_keys_before_its_window(tmp_path: Path) -> None:
    """Mixtral's layers all slide (12 tokens): with NaN in every cache slot before the
    window, the C step's tokens and logprobs are those of the clean cache (a key read and
    masked would still bring its NaN value in: 0 * NaN)."""
    model_dir = families.save("mixtral", tmp_path)
    prompt = list(range(60, 90))
    outputs = []
    for poison in (False, True):
        runner = make_runner(model_dir, max_num_seqs=4)
        request = DriverRequest(0, prompt, 2, LOGPROBS)
        driver = Driver(runner, 64)
        driver.run([request])  # the prompt and one decode: the next token sits at 31
        if poison:
            first = len(prompt) + 2 - 12  # the window of the next token's 32 keys starts here
            slots = [request.blocks[p // 8] * 8 + p % 8 for p in range(first)]
            for k, v in runner.kv_caches:
                k.view(-1, *k.shape[2:])[slots] = float("nan")
                v.view(-1, *v.shape[2:])[slots] = float("nan")
        request.max_tokens = MAX_TOKENS
        driver.run([request])
        assert runner.cpu_step is not None and runner.cpu_step.num_runs == MAX_TOKENS - 1
        outputs.append((request.output, np.concatenate([o.logprobs for o in request.outputs])))
    (clean, clean_lp), (poisoned, poisoned_lp) = outputs
    assert poisoned == clean
    np.testing.assert_array_equal(poisoned_lp, clean_lp)


@NEEDS_C
def test_longrope_switches_to_its_long_factors_as_the_context_passes_the_original(
    tmp_path: Path,
) -> None:
    """Phi-3's longrope: the sequence's context passes the original 256 tokens during the
    decodes; the C step reads the rotary table rows the torch path does. transformers'
    tokens agree until then: at the crossing its Phi-3 drops its cache and recomputes every
    key with the long factors, where trillm keeps the keys it has."""
    model_dir = families.save("phi3", tmp_path)
    prompts = [list(range(100, 350)), list(range(500, 520))]  # 250 tokens: 256 at its 7th
    _, eager_tokens, eager_lp = _run(model_dir, prompts, 12, enforce_eager=True)
    fused, tokens, lp = _run(model_dir, prompts, 12)
    assert fused.cpu_step is not None and fused.cpu_step.num_runs >= 10
    assert tokens == eager_tokens
    _assert_same(lp, eager_lp)
    hf = _reference(model_dir)
    expected = [families.greedy(hf, p, 12) for p in prompts]
    assert tokens[0][:7] == expected[0][:7]  # token 7 is the first at a context of 257
    assert tokens[1] == expected[1]


@NEEDS_C
def test_bfloat16_is_close(tmp_path: Path) -> None:
    """Gemma 3 in bfloat16 (q/k norms, the sandwich, GeGLU, windows, two rotary tables): the C
    step keeps the residual stream in float32 where torch rounds it at every add, so only
    closeness: the first tokens agree, then logprobs to 0.05 while they do. Without the
    final soft-cap: at 3.0 it leaves this tiny model's logits within ties of each other (top
    logprobs -8.6, of ln 49152 = -10.8), which bfloat16 rounding flips either way."""
    model_dir = families.save("gemma3_text", tmp_path, final_logit_softcapping=None)
    _, eager_tokens, eager_lp = _run(model_dir, PROMPTS, dtype="bfloat16", enforce_eager=True)
    fused, tokens, lp = _run(model_dir, PROMPTS, dtype="bfloat16")
    assert fused.cpu_step is not None and fused.cpu_step.num_runs >= MAX_TOKENS - 4
    layers = f"bfloat16 AMX ({pair_products()}) layers" if pairs_ready() else "bfloat16 layers"
    assert fused.kernels is not None and layers in fused.kernels.decode
    for got, want, got_lp, want_lp in zip(tokens, eager_tokens, lp, eager_lp, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))
        assert same >= 3, (got, want)
        np.testing.assert_allclose(got_lp[:same], want_lp[:same], atol=0.05)


@NEEDS_C
def test_a_head_dim_off_the_vector_width_windows_and_caps_each_head_alone(tmp_path: Path) -> None:
    """head_dim 12 (not a multiple of 16): each query head attends alone (`attend`, not
    `attend_group`), with Gemma 2's windows, soft-cap and scale."""
    model_dir = families.save("gemma2", tmp_path, head_dim=12)
    _, eager_tokens, eager_lp = _run(model_dir, PROMPTS, enforce_eager=True)
    fused, tokens, lp = _run(model_dir, PROMPTS)
    assert fused.model_config.head_dim == 12
    assert fused.cpu_step is not None and fused.cpu_step.num_runs >= MAX_TOKENS - 4
    assert tokens == eager_tokens
    _assert_same(lp, eager_lp)


LEVEL_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import numpy as np
from tests.gpu import families
from tests.gpu.conftest import make_runner
from tests.gpu.driver import Driver, DriverRequest
from trillm.gpu import SamplingOptions
options = SamplingOptions(temperature=0.0, logprobs=3)
for family in ("gemma2", "qwen3_moe"):
    model = families.save(family, Path(sys.argv[2]) / family)
    runs = []
    for eager in (True, False):
        runner = make_runner(model, enforce_eager=eager)
        requests = [DriverRequest(i, list(range(50 + i, 60 + 5 * i)), 6, options) for i in range(3)]
        Driver(runner, 64).run(requests)
        lp = [np.concatenate([o.logprobs for o in r.outputs]) for r in requests]
        runs.append(([r.output for r in requests], lp))
    assert runner.cpu_step is not None and runner.cpu_step.num_runs == 5, family
    assert runs[0][0] == runs[1][0], (family, runs)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
print("ok")
"""


@pytest.mark.slow
@NEEDS_C
def test_the_avx2_build_runs_the_families_too(tmp_path: Path) -> None:
    """The vector code the families brought (tanh for soft-caps, GeGLU, the experts) built
    for AVX2 (no AVX-512: each vector two registers) gives the torch path's tokens: Gemma 2
    and Qwen3-MoE. (SSE2 builds the same vector code; test_cpu_decode runs it for Llama.)"""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 levels")
    env = {**os.environ, "TRILLM_CPU_MARCH": "x86-64-v3", "TRILLM_CACHE_DIR": str(tmp_path)}
    root = str(Path(__file__).resolve().parents[2])
    command = [sys.executable, "-c", LEVEL_CHILD, root, str(tmp_path)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert list(tmp_path.glob("kernels/cpu_decode-*.so"))  # built for AVX2, apart


def _experts_kept_quantized(
    weights: Iterator[tuple[str, torch.Tensor]], qtype: Q
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint with its experts' weights in GGUF blocks (what a GGUF file brings)."""
    for name, tensor in weights:
        if ".experts." not in name:
            yield name, tensor
            continue
        raw = gguf.quants.quantize(tensor.float().numpy(), qtype)
        blocks = raw.reshape(tensor.shape[0], -1, BLOCK_BYTES[qtype])
        yield name, QuantizedTensor(qtype, torch.from_numpy(blocks.copy()))


def _quantized_runner(model_dir: Path, qtype: Q, *, enforce_eager: bool) -> ModelRunner:
    """A runner configured as for a GGUF file kept quantized, fed the safetensors checkpoint
    with its experts in blocks (the dense rest as a GGUF file's float32 tensors would be)."""
    config = WorkerConfig(
        str(model_dir),
        device="cpu",
        block_size=8,
        max_num_seqs=12,
        load_format="gguf",
        quantization="gguf",
        enforce_eager=enforce_eager,
    )
    model_config, weights = open_model(str(model_dir), "auto")
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cpu"))
    runner.load_model(_experts_kept_quantized(weights, qtype))
    runner.init_kv_cache(64)
    return runner


@NEEDS_C
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_experts_run_from_their_own_tiles(qtype: Q, tmp_path: Path) -> None:
    """Experts kept in GGUF blocks are `TiledLinear`s (gate/up in two halves, not
    interleaved): the C step reads those tiles, and gives the torch forward's tokens over
    the same tiles."""
    model_dir = families.save("qwen3_moe", tmp_path)
    eager = _quantized_runner(model_dir, qtype, enforce_eager=True)
    fused = _quantized_runner(model_dir, qtype, enforce_eager=False)
    decode = fused.cpu_step
    assert decode is not None
    experts = next(w.experts for w in decode.layers if w.experts is not None)
    assert experts.gate_up[0].kind == (Q8 if qtype == Q.Q8_0 else Q4) and not experts.interleaved
    _, eager_tokens, eager_lp = _run(eager, PROMPTS)
    _, tokens, lp = _run(fused, PROMPTS)
    assert decode.num_runs >= MAX_TOKENS - 4
    assert tokens == eager_tokens
    _assert_same(lp, eager_lp, atol=2e-4)


def test_without_a_compiler_every_family_takes_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides of the compiler probe: the start-up line says why (the same model built
    with the compiler, where there is one, takes the C step)."""
    model_dir = families.save("gemma2", tmp_path / "gemma2")
    config = WorkerConfig(str(model_dir), device="cpu")
    if tiled_kernels() is not None:
        decode, word = build_cpu_step(_fresh_model(model_dir), config, 8)
        assert decode is not None and word.startswith("c ("), word
    monkeypatch.setenv("TRILLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "no-such-cc")
    _native.load.cache_clear()
    try:
        decode, word = build_cpu_step(_fresh_model(model_dir), config, 8)
    finally:
        _native.load.cache_clear()
    assert decode is None
    assert word.startswith("torch (no C compiler 'no-such-cc'"), word


def _fresh_model(model_dir: Path) -> torch.nn.Module:
    """The family's model loaded and not packed (the C step tiles the dense weights)."""
    model_config, weights = open_model(str(model_dir), "auto")
    family = family_for(model_config.model_type)
    assert family is not None
    model = family.load().MODEL(model_config, TensorParallel(), torch.float32)
    model.load_weights(weights)
    return model
