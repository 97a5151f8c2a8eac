"""Pooling requests (embeddings) end to end on the engine, against transformers' own hidden
states pooled by hand in float32: every pooling type, alone and batched with generation,
chunked, with and without prefix-cache hits; and the pooler's settings from a model folder."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import trio

from trillm.default_model import default_model_dir
from trillm.engine.client import (
    AsyncLLM,
    EngineConfig,
    LLMConfig,
    PoolerConfig,
    PoolerConfigError,
    PoolingType,
    PromptTooLongError,
    finish_embedding,
    load_pooler_config,
    open_llm,
)
from trillm.engine.client.inputs._sampling_params import SamplingParams
from trillm.gpu import WorkerConfig

from ...gpu import families
from ...gpu.conftest import save_tiny

LENGTHS = (5, 40, 100, 130)  # over 64: chunked; 130 fills blocks past a 128 prefix hit


def reference(model: transformers.PreTrainedModel, ids: list[int], kind: PoolingType) -> np.ndarray:
    """transformers' last hidden state (after the final norm), pooled by hand."""
    with torch.no_grad():
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        hidden = base(torch.tensor([ids])).last_hidden_state[0].float()
    rows = {
        PoolingType.LAST: hidden[-1:],
        PoolingType.MEAN: hidden.mean(0, keepdim=True),
        PoolingType.CLS: hidden[:1],
        PoolingType.ALL: hidden,
    }[kind]
    return rows.numpy()


def min_cosine(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    dots = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    return float(dots.min())


def config(model: Path, **worker: object) -> LLMConfig:
    worker_config = WorkerConfig(
        str(model),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_bytes=1 << 25,
        max_num_batched_tokens=64,  # prompts over 64 tokens are chunked
        **worker,  # type: ignore[arg-type]
    )
    return LLMConfig(EngineConfig(worker=worker_config), start_timeout=120, in_process=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"pool-{request.param}")
    if request.param == "llama":
        return save_tiny(path, "llama")
    return families.save(request.param, path)


@pytest.fixture
async def llm(model_dir: Path) -> AsyncIterator[AsyncLLM]:
    async with open_llm(config(model_dir)) as llm:
        yield llm


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 4000, n).tolist() for n in LENGTHS]


async def check_embeddings(llm: AsyncLLM, model_dir: Path, kinds: list[PoolingType]) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = prompts()
    for kind in kinds:
        alone = [await llm.encode(ids, kind) for ids in batch[:2]]
        together: dict[int, np.ndarray] = {}  # filled in the nursery below, read after it
        async with trio.open_nursery() as nursery:

            async def one(
                i: int, kind: PoolingType = kind, out: dict[int, np.ndarray] = together
            ) -> None:
                out[i] = (await llm.encode(batch[i], kind)).data

            async def generate() -> None:  # a generation in the same steps
                params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
                assert len((await llm.complete(batch[1], params))[0].token_ids) == 8

            nursery.start_soon(generate)
            for i in range(len(batch)):
                nursery.start_soon(one, i)
        for i, ids in enumerate(batch):
            want = reference(model, ids, kind)
            assert min_cosine(together[i], want) >= 0.9999, (kind, len(ids))
            if i < len(alone):
                assert min_cosine(alone[i].data, want) >= 0.9999, (kind, len(ids))
                assert alone[i].num_prompt_tokens == len(ids)
    again = await llm.encode(batch[3], PoolingType.LAST)  # its 128-token prefix is cached
    assert again.num_cached_tokens == 128
    assert min_cosine(again.data, reference(model, batch[3], PoolingType.LAST)) >= 0.9999
    mean = await llm.encode(batch[3], PoolingType.MEAN)  # MEAN computes every position
    assert mean.num_cached_tokens == 0


async def test_embeddings_equal_transformers_hidden_states(llm: AsyncLLM, model_dir: Path) -> None:
    await check_embeddings(llm, model_dir, list(PoolingType)[1:])


@pytest.mark.slow
async def test_default_model_embeddings_equal_transformers() -> None:
    model_dir = default_model_dir(progress=False)
    async with open_llm(config(model_dir, max_model_len=512)) as llm:
        await check_embeddings(llm, model_dir, [PoolingType.LAST, PoolingType.MEAN])


async def test_too_long_is_refused_unless_cut(tmp_path: Path) -> None:
    async with open_llm(config(save_tiny(tmp_path, "llama"), max_model_len=32)) as llm:
        with pytest.raises(PromptTooLongError, match=r"33 tokens, more than .* 32") as info:
            await llm.encode(list(range(3, 36)))
        assert info.value.param == "input"
        full = await llm.encode(list(range(3, 35)))  # exactly max_model_len: no output needed
        cut = await llm.encode(list(range(1, 35)), truncate_prompt_tokens=32)
        assert cut.num_prompt_tokens == 32 and np.allclose(cut.data, full.data, atol=1e-5)
        # A text whose characters alone are over the cap is cut, not refused by its head.
        text = "the quick brown fox " * 100
        with pytest.raises(PromptTooLongError, match="more than the model's maximum length"):
            await llm.encode(text)
        cut = await llm.encode(text, truncate_prompt_tokens=16)
        tail = await llm.encode(llm.tokenizer(text)["input_ids"][-16:])
        assert cut.num_prompt_tokens == 16 and np.allclose(cut.data, tail.data, atol=1e-5)
        assert llm.num_request_states == 0


def test_finish_embedding_cuts_then_normalises() -> None:
    rows = np.array([[3.0, 4.0, 12.0]], np.float32)
    assert np.allclose(finish_embedding(rows, normalize=True, dimensions=2), [[0.6, 0.8]])
    assert np.allclose(finish_embedding(rows, normalize=False, dimensions=None), rows)
    assert np.allclose(finish_embedding(rows, normalize=True, dimensions=None), rows / 13)


def write_sentence_transformers(path: Path, mode: str, normalize: bool) -> None:
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{mode}": True}))


def test_pooler_config_from_sentence_transformers_files(tmp_path: Path) -> None:
    assert load_pooler_config(str(tmp_path)) == PoolerConfig(PoolingType.LAST, True)
    write_sentence_transformers(tmp_path, "mean_tokens", normalize=False)
    assert load_pooler_config(str(tmp_path)) == PoolerConfig(PoolingType.MEAN, False)
    flag = '{"pooling_type": "cls", "normalize": true}'
    assert load_pooler_config(str(tmp_path), flag) == PoolerConfig(PoolingType.CLS, True)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("{", "--pooler-config is not JSON"),
        ("[]", "must be a JSON object"),
        ('{"pooling": "LAST"}', "unknown key\\(s\\) pooling"),
        ('{"pooling_type": "MAX"}', "pooling_type must be one of LAST, MEAN, CLS, ALL"),
        ('{"normalize": 1}', "normalize must be true or false"),
    ],
)
def test_a_bad_pooler_config_says_what_is_accepted(tmp_path: Path, flag: str, message: str) -> None:
    with pytest.raises(PoolerConfigError, match=message):
        load_pooler_config(str(tmp_path), flag)
