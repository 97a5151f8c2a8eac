"""LoRA deltas inside the C decode step (`csrc/tl_lora.h`) against the torch path's.

The same requests, adapters mixed with the base in every step, run through the real runner
twice: with the C step (each decode step in one C call, deltas added after each product) and
with `--enforce-eager` (the torch linears' `LoraLinear.add_delta`). Tokens and logprobs must
agree (float32 to ~1e-4; bfloat16 only closely, as in test_cpu_decode), the decode steps
with adapter rows must run in C, and the tokens must be peft's merged model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from trillm.common.wire import LoraModule
from trillm.default_model import default_model_dir
from trillm.gpu import SamplingOptions
from trillm.gpu.cpu._tiles import tiled_kernels

from .conftest import TINY, make_runner, save_tiny
from .driver import Driver, DriverRequest
from .lora_adapters import make_adapter, merged_greedy

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(tiled_kernels() is None, reason="no C compiler here: no C step"),
]
LOGPROBS = SamplingOptions(temperature=0.0, logprobs=3)
PROMPTS = [list(range(100 + 37 * i, 109 + 37 * i + 5 * i)) for i in range(8)]
N = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("lora-c"), "llama")


@pytest.fixture(scope="module")
def odd_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 12: q, k, v of 48, 24, 24 rows, so a 16-row tile spans k's end and v's start."""
    path = tmp_path_factory.mktemp("lora-c-odd")
    config = transformers.LlamaConfig(**{**TINY, "hidden_size": 48}, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir(progress=False) / name, path / name)
    return path


def adapters(model: Path, root: Path) -> list[Path]:
    """Three adapters unlike each other: every target at rank 8; rsLoRA at rank 16; q and v
    alone at rank 4 (the other linears of that slot add nothing)."""
    return [
        make_adapter(model, root / "a", seed=1, r=8),
        make_adapter(model, root / "b", seed=2, r=16, rslora=True),
        make_adapter(model, root / "c", seed=3, r=4, targets=("q_proj", "v_proj")),
    ]


def run(model: Path, paths: list[Path], lora_ids: list[int], **kw: object):  # type: ignore[no-untyped-def]
    """Greedy runs of `PROMPTS` (request i: adapter lora_ids[i], 0 the base) in one batch."""
    runner = make_runner(model, enable_lora=True, max_loras=3, max_num_seqs=12, **kw)
    for i, path in enumerate(paths, start=1):
        runner.add_lora(LoraModule(f"a{i}", str(path), None, i))
    requests = [
        DriverRequest(i, p, N, LOGPROBS, lora_id=lora_id)
        for i, (p, lora_id) in enumerate(zip(PROMPTS, lora_ids, strict=True))
    ]
    Driver(runner, 64).run(requests)
    logprobs = [np.concatenate([o.logprobs for o in r.outputs]) for r in requests]
    return runner, [r.output for r in requests], logprobs


LORA_IDS = [1, 0, 2, 3, 1, 0, 3, 2]  # 3 adapters and the base, interleaved (no group is a run)


@pytest.mark.parametrize("model", ["tiny", "odd_heads"])
def test_mixed_slots_in_the_c_step_equal_the_torch_deltas_and_peft(
    model: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir: Path = request.getfixturevalue(model)
    paths = adapters(model_dir, tmp_path)
    eager, eager_tokens, eager_lp = run(model_dir, paths, LORA_IDS, enforce_eager=True)
    fused, tokens, lp = run(model_dir, paths, LORA_IDS)
    assert eager.cpu_step is None
    assert fused.cpu_step is not None
    assert fused.cpu_step.num_lora_runs == N - 1  # every decode step, adapters and all
    assert not fused._lora_fallback_logged
    assert tokens == eager_tokens
    for a, b in zip(lp, eager_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)
    if model == "tiny":  # peft's merged model, per adapter (cheap on the tiny model)
        for i in (0, 1, 2, 3):
            adapter = paths[LORA_IDS[i] - 1] if LORA_IDS[i] else None
            assert tokens[i] == merged_greedy(model_dir, adapter, PROMPTS[i], N), i


def test_base_rows_alone_take_the_c_step_without_deltas(tiny: Path, tmp_path: Path) -> None:
    """With LoRA on and no request naming an adapter, the C step adds nothing: the tokens are
    those of a runner without LoRA."""
    paths = adapters(tiny, tmp_path)
    on, tokens, lp = run(tiny, paths, [0] * len(PROMPTS))
    plain = make_runner(tiny, max_num_seqs=12)
    requests = [DriverRequest(i, p, N, LOGPROBS) for i, p in enumerate(PROMPTS)]
    Driver(plain, 64).run(requests)
    assert on.cpu_step is not None and on.cpu_step.num_runs == N - 1
    assert on.cpu_step.num_lora_runs == 0
    assert tokens == [r.output for r in requests]
    for got, r in zip(lp, requests, strict=True):
        np.testing.assert_array_equal(got, np.concatenate([o.logprobs for o in r.outputs]))


def test_bfloat16_deltas_in_the_c_step_are_close(tiny: Path, tmp_path: Path) -> None:
    paths = adapters(tiny, tmp_path)
    _, eager_tokens, eager_lp = run(tiny, paths, LORA_IDS, dtype="bfloat16", enforce_eager=True)
    fused, tokens, lp = run(tiny, paths, LORA_IDS, dtype="bfloat16")
    assert fused.cpu_step is not None and fused.cpu_step.num_lora_runs == N - 1
    for got, want, got_lp, want_lp in zip(tokens, eager_tokens, lp, eager_lp, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), N)
        assert same >= 3, (got, want)  # the prefill's token and at least two C steps agree
        np.testing.assert_allclose(got_lp[:same], want_lp[:same], atol=0.05)


def test_c_step_slots_must_match_the_tokens(tiny: Path) -> None:
    runner = make_runner(tiny)
    assert runner.cpu_step is not None
    with pytest.raises(ValueError, match="built without LoRA"):
        runner.cpu_step.run(
            torch.tensor([5]),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            np.ones(1, np.int32),
            np.zeros((1, 1), np.int32),
            lora_slots=np.zeros(1, np.int32),
        )
