"""Every model family against transformers: greedy tokens, batched and alone, in chunks.

The models (`families.py`) are tiny seeded random ones built here, with what each family adds
made to matter: sliding windows shorter than the prompts, soft-caps that bite, multipliers,
layers without rotary, partial rotary with longrope, routed experts. The reference is
transformers' own implementation of each family, in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from trillm.gpu import ModelConfig, ModelConfigError, Worker, WorkerConfig

from . import families
from .conftest import make_runner
from .driver import Driver, DriverRequest
from .tp_peer import generate, generate_tp2

pytestmark = pytest.mark.timeout(300)
PROMPTS = [list(range(50, 50 + n)) for n in (3, 17, 9, 30)]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=families.DENSE + families.MOE)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return families.save(request.param, tmp_path_factory.mktemp(request.param))


def _reference(model_dir: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.config.model_type == "gemma2":
        model.config._attn_implementation = "eager"  # transformers' SDPA has no soft-cap
    return model.eval()


def test_greedy_tokens_equal_transformers_batched_alone_and_in_chunks(family_dir: Path) -> None:
    hf = _reference(family_dir)
    expected = [families.greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]
    runner = make_runner(family_dir)
    assert runner.kernels is not None  # the start-up line names the decode path and why
    assert runner.kernels.decode.startswith(("c (", "torch (")), runner.kernels.decode
    batched = [DriverRequest(i, p, MAX_TOKENS, arrival_step=i) for i, p in enumerate(PROMPTS)]
    Driver(runner, 64, chunk=5).run(batched)  # prefill chunks of 5 beside decodes
    assert [r.output for r in batched] == expected
    alone = [DriverRequest(9, PROMPTS[3], MAX_TOKENS)]
    Driver(make_runner(family_dir), 64).run(alone)
    assert alone[0].output == expected[3]


def test_an_unsupported_model_type_lists_the_supported_ones() -> None:
    config = dict(families.BASE, model_type="falcon_h9", num_hidden_layers=2)
    with pytest.raises(ModelConfigError, match="model_type 'falcon_h9' is not supported") as info:
        ModelConfig.from_dict(config)
    for model_type in ("llama", "qwen3", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "mixtral"):
        assert model_type in str(info.value)


SHARED = list(range(300, 340))  # 40 tokens: five blocks of 8 shared by every prompt below
ENGINE_PROMPTS = [[*SHARED, 7, 8, 9], SHARED + list(range(500, 520)), [*SHARED, 11]]


def _engine_outputs(model_dir: Path) -> list[tuple[list[int], int]]:
    """Greedy tokens and cached prompt tokens of `ENGINE_PROMPTS` through the real engine:
    prefix caching on, chunked prefill (12-token budget), blocks of 8; the first prompt runs
    first, so the others find its blocks cached."""
    from trillm import LLM
    from trillm.engine.client import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    args = dict(device="cpu", dtype="float32", kv_cache_bytes=1 << 25, start_timeout=120)
    with LLM(
        str(model_dir),
        block_size=8,
        max_num_batched_tokens=12,
        enable_prefix_caching=True,
        **args,  # type: ignore[arg-type]
    ) as llm:
        first = llm.generate([ENGINE_PROMPTS[0]], params, use_tqdm=False)
        rest = llm.generate(ENGINE_PROMPTS[1:], params, use_tqdm=False)
    return [(r.outputs[0].token_ids, r.num_cached_tokens) for r in first + rest]


def _check_engine(model_dir: Path) -> None:
    hf = _reference(model_dir)
    outputs = _engine_outputs(model_dir)
    assert [tokens for tokens, _ in outputs] == [
        families.greedy(hf, p, MAX_TOKENS) for p in ENGINE_PROMPTS
    ]
    assert [cached for _, cached in outputs][1:] == [40, 40]  # the shared blocks were reused


@pytest.mark.slow
def test_the_engine_with_prefix_caching_and_chunked_prefill_gives_transformers_tokens(
    tmp_path: Path,
) -> None:
    """A sliding-window family; every other family in the next test."""
    _check_engine(families.save("gemma2", tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(families.DENSE + families.MOE) - {"gemma2"}))
def test_every_family_through_the_engine_gives_transformers_tokens(
    family: str, tmp_path: Path
) -> None:
    _check_engine(families.save(family, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmo2", "qwen3_moe", "phi3"])
def test_tensor_parallel_2_gives_the_tokens_of_1(family: str, tmp_path: Path) -> None:
    """OLMo 2's q/k norms span both ranks' heads (an all-reduced sum of squares); Qwen3-MoE's
    experts are split along their intermediate dimension; Phi-3's fused tensors are split
    per part."""
    model_dir = families.save(family, tmp_path)
    config = WorkerConfig(
        str(model_dir), device="cpu", dtype="float32", block_size=8, kv_cache_bytes=1 << 24
    )
    assert generate_tp2(model_dir) == generate(Worker(config))


def test_a_prompt_past_the_original_context_takes_longrope_long_factors(tmp_path: Path) -> None:
    """Phi-3's longrope (original context 256): a 300-token prompt takes the long factors
    for all its tokens, as transformers does (it decides per forward on the longest
    position). A sequence that crosses 256 while decoding differs: transformers' Phi-3 drops
    its KV cache there and recomputes it with the long factors; we keep it (docs/design.md)."""
    model_dir = families.save("phi3", tmp_path)
    prompt = [(7 * i) % 4000 + 100 for i in range(300)]
    expected = families.greedy(_reference(model_dir), prompt, 10)
    request = DriverRequest(0, prompt, 10)
    Driver(make_runner(model_dir), 64).run([request])
    assert request.output == expected
