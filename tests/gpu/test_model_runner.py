"""The runner against transformers' reference forward, on tiny random models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from trillm.gpu import (
    CpuFeatures,
    CpuLinearUnsupportedError,
    ModelRunner,
    NewRequest,
    SamplingOptions,
    StepBatch,
    probe_cpu_features,
)

from .conftest import make_runner, save_tiny
from .driver import Driver, DriverRequest


class CapturingSampler:
    """Wraps the runner's sampler and records the logits it is given."""

    def __init__(self, sampler: object) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, batch: object) -> object:
        self.logits.append(logits.clone())
        return self.sampler(logits, batch)  # type: ignore[operator]


def reference_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_logits_equal_transformers_for_mixed_prefill_chunks_and_decodes(
    tiny_model_dir: Path, attention: str
) -> None:
    """Both attention backends (triton through its interpreter on CPU)."""
    runner = make_runner(tiny_model_dir, attention_backend=attention)
    capture = CapturingSampler(runner.sampler)
    runner.sampler = capture  # type: ignore[assignment]
    prompts = [list(range(100, 123)), list(range(300, 305)), list(range(7, 20)), [42]]
    requests = [
        DriverRequest(0, prompts[0], max_tokens=4),  # chunks of 6 while others decode
        DriverRequest(1, prompts[1], max_tokens=6),
        DriverRequest(2, prompts[2], max_tokens=3, arrival_step=2),
        DriverRequest(3, prompts[3], max_tokens=3, arrival_step=3),
    ]
    driver = Driver(runner, 64, chunk=6)
    driver.run(requests)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    produced = {r.rnum: 0 for r in requests}
    sampling_steps = [out for out in driver.history if len(out.rnums)]
    assert len(sampling_steps) == len(capture.logits)
    mixed = 0
    for out, logits in zip(sampling_steps, capture.logits, strict=True):
        mixed += len(out.rnums) > 1
        for row, rnum in enumerate(out.rnums.tolist()):
            request = requests[rnum]
            context = request.prompt + request.output[: produced[rnum]]
            produced[rnum] += 1
            torch.testing.assert_close(
                logits[row], reference_logits(hf, context), atol=1e-4, rtol=0
            )
    assert produced == {r.rnum: r.max_tokens for r in requests}
    assert mixed >= 3


# Every family's logits at every sampled step equal transformers' in `make test` (above);
# 8 prompts x 12 greedy tokens against `generate` stay there on the tiny Llama only.
@pytest.mark.parametrize(
    "tiny_model_dir",
    [
        "llama",
        pytest.param("llama3", marks=pytest.mark.slow),
        pytest.param("qwen2", marks=pytest.mark.slow),
    ],
    indirect=True,
)
def test_greedy_generation_equals_transformers_generate(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir)
    prompts = [list(range(50, 50 + n)) for n in (3, 17, 9, 1, 30, 12, 5, 21)]
    requests = [DriverRequest(i, p, max_tokens=12) for i, p in enumerate(prompts)]
    Driver(runner, 64).run(requests)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for request in requests:
        expected = hf.generate(
            torch.tensor([request.prompt]),
            attention_mask=torch.ones(1, len(request.prompt), dtype=torch.long),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )[0, len(request.prompt) :].tolist()
        assert request.output == expected, request.rnum


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir: Path, chunk: int) -> None:
    prompts = [list(range(200, 200 + n)) for n in (13, 2, 27)]
    runner = make_runner(tiny_model_dir)
    reqs = [DriverRequest(i, p, max_tokens=5) for i, p in enumerate(prompts)]
    Driver(runner, 64, chunk=chunk).run(reqs)
    baseline = make_runner(tiny_model_dir)
    base = [DriverRequest(i, p, max_tokens=5) for i, p in enumerate(prompts)]
    Driver(baseline, 64).run(base)
    assert [r.output for r in reqs] == [r.output for r in base]


def test_prompt_logprobs_match_log_softmax(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir)
    prompt = list(range(60, 75))
    options = SamplingOptions(temperature=0.0, prompt_logprobs=3)
    driver = Driver(runner, 64, chunk=4)
    driver.run([DriverRequest(0, prompt, max_tokens=2, options=options)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    chunks = [out.prompt_logprobs[0] for out in driver.history if out.prompt_logprobs]
    assert [c.first_position for c in chunks] == [1, 5, 9, 13]  # chunks of 4 prompt tokens
    logprobs = torch.from_numpy(np.concatenate([c.logprobs for c in chunks]))
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)
    top = ref[: len(prompt) - 1].topk(3)
    ids = np.concatenate([c.topk_ids for c in chunks if c.topk_ids is not None])
    assert ids.tolist() == top.indices.tolist()


def test_the_tiny_model_speaks_smollm2s_tokenizer(tiny_model_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert len(tokenizer) == 49152


def test_sharded_checkpoints_and_llama3_rope_scaling_are_read(tmp_path: Path) -> None:
    model_dir = save_tiny(tmp_path, "llama3")  # saved in shards, with llama3 RoPE scaling
    assert (model_dir / "model.safetensors.index.json").exists()
    runner = make_runner(model_dir)
    assert runner.model_config.rope_scaling is not None
    assert runner.model_config.rope_scaling["rope_type"] == "llama3"


def test_dummy_weights_run_without_a_checkpoint(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, load_format="dummy")
    requests = [DriverRequest(0, [5, 6, 7], max_tokens=4)]
    Driver(runner, 64).run(requests)
    assert len(requests[0].output) == 4


def greedy_outputs(runner: ModelRunner) -> tuple[list[int], torch.Tensor]:
    """Five greedy tokens of one prompt, and the logits of another's first step."""
    requests = [DriverRequest(0, list(range(100, 131)), max_tokens=5)]
    Driver(runner, 64).run(requests)
    capture = CapturingSampler(runner.sampler)
    runner.sampler = capture  # type: ignore[assignment]
    Driver(runner, 64).run([DriverRequest(1, list(range(200, 219)), max_tokens=2)])
    return requests[0].output, capture.logits[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_onednn_packed_linears_match_aten(tiny_model_dir: Path, dtype: str) -> None:
    """The oneDNN path (packed weights, dense copies dropped) and plain F.linear agree, on
    every dtype this CPU's oneDNN packs (float32 on any x86-64 CPU)."""
    if dtype not in probe_cpu_features().onednn_packs:
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU ({probe_cpu_features().summary()})")
    packed = make_runner(tiny_model_dir, dtype=dtype)
    plain = make_runner(tiny_model_dir, dtype=dtype, cpu_linear="aten")
    assert packed.kernels is not None and packed.kernels.linear == "onednn"
    assert packed.model.layers[0].mlp.down_proj.packed is not None
    assert packed.model.layers[0].mlp.down_proj.weight.numel() == 0
    assert plain.model.layers[0].mlp.down_proj.packed is None
    (tokens, logits), (plain_tokens, plain_logits) = greedy_outputs(packed), greedy_outputs(plain)
    assert tokens == plain_tokens
    tolerance = 1e-4 if dtype == "float32" else 0.1
    torch.testing.assert_close(logits, plain_logits, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_that_cannot_pack_the_dtype_runs_plain_linears(
    tiny_model_dir: Path, dtype: str
) -> None:
    """The probe forced to answer "no oneDNN for this dtype" (an AVX2-only CPU for bfloat16):
    the model loads and runs on F.linear, on any machine, and says why."""
    cannot = CpuFeatures("AVX2", onednn_packs=frozenset({"float32"} - {dtype}))
    runner = make_runner(tiny_model_dir, dtype=dtype, cpu_features=cannot)
    assert runner.kernels is not None and runner.kernels.linear == "aten"
    assert f"cannot pack {dtype}" in runner.kernels.reason or "no oneDNN" in runner.kernels.reason
    assert runner.model.layers[0].mlp.down_proj.packed is None
    plain = make_runner(tiny_model_dir, dtype=dtype, cpu_linear="aten")
    assert greedy_outputs(runner)[0] == greedy_outputs(plain)[0]


def test_onednn_forced_on_a_cpu_that_cannot_pack_fails_before_loading(tiny_model_dir: Path) -> None:
    avx2 = CpuFeatures("AVX2", onednn_packs=frozenset({"float32"}))
    with pytest.raises(CpuLinearUnsupportedError, match="cannot pack bfloat16 on this CPU"):
        make_runner(tiny_model_dir, dtype="bfloat16", cpu_linear="onednn", cpu_features=avx2)


def test_pooled_rows_are_read_in_the_steps_one_host_read(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MEAN request in two chunks beside a sampling request, then a LAST request alone (a
    step that samples nothing): `Pooler.pool` hands back a device tensor, each step calls
    `to_host` once and the pooled block is among what it reads, and the rows equal
    transformers' hidden states."""
    from trillm.common.wire import PoolingType
    from trillm.gpu.runner import _model_runner

    runner = make_runner(tiny_model_dir)
    reads: list[list[object]] = []
    to_host = _model_runner.to_host

    def counting(*tensors: torch.Tensor | None) -> list[np.ndarray | None]:
        reads.append(list(tensors))
        return to_host(*tensors)

    monkeypatch.setattr(_model_runner, "to_host", counting)
    pools: list[object] = []
    pool = runner.pooler.pool

    def recording(*args: object) -> object:
        result = pool(*args)  # type: ignore[arg-type]
        pools.append(result[2])
        return result

    monkeypatch.setattr(runner.pooler, "pool", recording)
    mean, plain, last = list(range(80, 92)), list(range(30, 35)), list(range(5, 14))

    def step(n: int, news: list[NewRequest], cached: list[int], sched: list[tuple[int, int]]):
        batch = StepBatch(n, new_requests=news)
        batch.cached_rnums = np.array(cached, np.uint64)
        batch.cached_new_block_ids = [[] for _ in cached]
        batch.cached_num_computed = np.array([8] * len(cached), np.int32)
        batch.scheduled_rnums = np.array([r for r, _ in sched], np.uint64)
        batch.num_scheduled_tokens = np.array([c for _, c in sched], np.int32)
        reads.clear()
        out = runner.execute(batch)
        assert len(reads) == 1  # the step's one read to the host
        return out

    pooling = SamplingOptions(pooling=PoolingType.MEAN)
    news = [NewRequest(0, mean, [0, 1], 0, pooling), NewRequest(1, plain, [2], 0)]
    first = step(0, news, [], [(0, 8), (1, 5)])
    assert first.pooled is None and first.rnums.tolist() == [1]
    second = step(1, [], [0], [(0, 4)])  # the MEAN prompt ends; nothing samples
    assert second.pooled is not None and not len(second.rnums)
    assert isinstance(pools[-1], torch.Tensor) and any(t is pools[-1] for t in reads[0])
    news = [
        NewRequest(2, last, [3, 4], 0, SamplingOptions(pooling=PoolingType.LAST)),
        NewRequest(3, plain, [5], 0),
    ]
    third = step(2, news, [], [(2, 9), (3, 5)])  # LAST pooled beside a sampled token
    assert third.pooled is not None and third.rnums.tolist() == [3]
    assert isinstance(pools[-1], torch.Tensor) and any(t is pools[-1] for t in reads[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = [hf.model(torch.tensor([p])).last_hidden_state[0] for p in (mean, last)]
    assert second.pooled_rnums is not None and second.pooled_rnums.tolist() == [0]
    assert third.pooled_rnums is not None and third.pooled_rnums.tolist() == [2]
    got = torch.from_numpy(np.concatenate([second.pooled, third.pooled]))
    torch.testing.assert_close(
        got, torch.stack([hidden[0].mean(0), hidden[1][-1]]), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("c_amx", [True, False])
@pytest.mark.parametrize("amx", [True, False])
def test_the_c_step_takes_its_whole_build_whatever_the_cpu_has(
    tiny_model_dir: Path, amx: bool, c_amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 on an AMX CPU whose C step has no AMX tiles (`c_amx` off, or `amx_ready`
    false here) once capped the C step at 16 decodes by an ISA rule; which sizes it takes is
    now measured (`_decode_probe`, tests/gpu/test_decode_probe.py), so its bound is its build
    (`MAX_BATCH`) on every CPU, in bfloat16 and float32."""
    from trillm.gpu.cpu import _tiles
    from trillm.gpu.cpu._cpu_decode import MAX_BATCH

    if "bfloat16" not in probe_cpu_features().onednn_packs:
        pytest.skip(f"oneDNN cannot pack bfloat16 here ({probe_cpu_features().summary()})")
    monkeypatch.setattr(_tiles, "AMX_ENABLED", c_amx)
    features = CpuFeatures("AVX512", amx=amx, onednn_packs=frozenset({"float32", "bfloat16"}))
    runner = make_runner(tiny_model_dir, dtype="bfloat16", cpu_features=features)
    assert runner.cpu_step is not None and runner.cpu_step.max_batch == MAX_BATCH
    assert ("bfloat16 AMX" in runner.cpu_step.kinds()) == _tiles.pairs_ready()
    assert f"up to {MAX_BATCH} decodes" in (runner.kernels.decode or "")
    fp32 = make_runner(tiny_model_dir, cpu_features=features)
    assert fp32.cpu_step is not None and fp32.cpu_step.max_batch == MAX_BATCH
