"""The runner on CUDA: triton attention against torch, greedy tokens against transformers, and
CUDA-graph replay against eager. Marked `gpu` and skipped without CUDA; `perf/gpu_check.sh`
runs them on a lent GPU.

Greedy tokens of two correct implementations can part at a near tie (two logits closer than
the arithmetic's error: bf16 rounding, TF32 inside a kernel, another GEMM tiling). So tokens
are compared up to the first difference, which must be a near tie of the reference's logits
(within `tie`), and most tokens must agree; while contexts are equal, the logits themselves
must agree within `tol` of their standard deviation. A broken kernel fails both by far.

The models are saved without a tokenizer: `save_tiny` copies SmolLM2's from the default
model, which the GPU machine lacks, and the runner reads none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from trillm.gpu import (
    ModelRunner,
    NewRequest,
    SamplingOptions,
    StepBatch,
    TensorParallel,
    WorkerConfig,
    open_model,
)

from .conftest import TINY
from .driver import Driver, DriverRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (perf/gpu_check.sh runs it on a GPU)"
    ),
    pytest.mark.timeout(120),  # under gpu_check.sh's session timeout: a hang fails one test
]

HEAD_DIM_64 = {**TINY, "hidden_size": 256, "intermediate_size": 512}  # 4 heads of 64, 2 KV
TIE_FP32 = 2e-3  # logits have a std of about 0.16 (TINY) to 0.3 (HEAD_DIM_64)
TIE_HALF = 5e-2


def save_llama(path: Path, shape: dict[str, object]) -> Path:
    """A tiny random Llama with tied embeddings (as `save_tiny`'s "llama"), no tokenizer."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("cuda-tiny"), TINY)


@pytest.fixture(scope="module")
def head_dim_64_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("cuda-hd64"), HEAD_DIM_64)


def cuda_runner(
    model_dir: Path, dtype: str, *, attention_backend: str = "auto", graphs: bool = False
) -> ModelRunner:
    """A loaded runner on CUDA; with `graphs`, decode graphs captured as the worker does."""
    config = WorkerConfig(
        str(model_dir),
        device="cuda",
        dtype=dtype,
        block_size=16,
        max_num_seqs=16,
        attention_backend=attention_backend,
        enforce_eager=not graphs,
    )
    model_config, weights = open_model(config.model, config.load_format)
    runner = ModelRunner(config, model_config, TensorParallel(), torch.device("cuda", 0))
    runner.load_model(weights)
    runner.init_kv_cache(256)
    if graphs:
        runner.capture_cuda_graphs()
    return runner


class CapturingSampler:
    """Wraps the runner's sampler and keeps (on the CPU) the logits it is given."""

    def __init__(self, sampler: object) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, batch: object) -> object:
        self.logits.append(logits.float().cpu())
        return self.sampler(logits, batch)  # type: ignore[operator]


@dataclass
class GreedyRun:
    requests: list[DriverRequest]
    # Per rnum, the logits of each sampled token; None when the sampler did not see every
    # sampling step's logits (a path that samples without the runner's sampler).
    logits: dict[int, list[torch.Tensor]] | None


def run_greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    chunk: int = 1 << 30,
    arrivals: list[int] | None = None,
    first_rnum: int = 0,
) -> GreedyRun:
    """Greedy generation of `max_tokens` each (no early EOS, as `min_new_tokens`); the
    requests are released from the runner afterwards."""
    options = SamplingOptions(temperature=0.0, min_tokens=max_tokens)
    requests = [
        DriverRequest(first_rnum + i, p, max_tokens, options, (arrivals or [0] * len(prompts))[i])
        for i, p in enumerate(prompts)
    ]
    driver = Driver(runner, runner.kv_caches[0][0].shape[0], chunk=chunk)
    capture = CapturingSampler(runner.sampler)
    runner.sampler = capture  # type: ignore[assignment]
    try:
        driver.run(requests)
    finally:
        runner.sampler = capture.sampler  # type: ignore[assignment]
    finished = np.array([r.rnum for r in requests], np.uint64)
    runner.execute(StepBatch(driver.step, finished_rnums=finished))  # the driver never says so
    sampling = [out for out in driver.history if len(out.rnums)]
    if len(sampling) != len(capture.logits):
        return GreedyRun(requests, None)
    logits: dict[int, list[torch.Tensor]] = {r.rnum: [] for r in requests}
    for out, step_logits in zip(sampling, capture.logits, strict=True):
        for row, rnum in enumerate(out.rnums.tolist()):
            logits[rnum].append(step_logits[row])
    return GreedyRun(requests, logits)


def agreeing_prefix(
    ours: list[int], reference: list[int], ref_logits: list[torch.Tensor], tie: float, what: str
) -> int:
    """How many tokens agree before the first difference, which must be a near tie."""
    for k, (got, want) in enumerate(zip(ours, reference, strict=True)):
        if got != want:
            lead = float(ref_logits[k][want] - ref_logits[k][got])
            assert lead <= tie, (
                f"{what}: token {k} is {got}, but the reference's {want} leads it by {lead:.3g} "
                f"(more than a near tie, {tie:g}); tokens {ours} vs {reference}"
            )
            return k
    return len(reference)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.std())


def compare_runs(reference: GreedyRun, got: GreedyRun, *, tie: float, tol: float) -> None:
    """`got`'s tokens are `reference`'s up to a first difference that is a near tie (after
    it the contexts differ: nothing later compares); where both have logits for the same
    context, they agree within `tol` (relative to the logits' std): the real check.

    A request that diverges at a near tie agrees (issue 48: one early bf16 near tie failed
    a rule of 90% of the tokens agreeing, though every logit was within tolerance)."""
    assert reference.logits is not None
    worst, compared = 0.0, 0
    for ref, ours in zip(reference.requests, got.requests, strict=True):
        ref_logits = reference.logits[ref.rnum]
        n = agreeing_prefix(ours.output, ref.output, ref_logits, tie, f"request {ref.rnum}")
        if got.logits is not None:  # sample k has the same context while tokens < k agree
            for k in range(min(n + 1, len(ref.output))):
                worst = max(worst, relative_error(got.logits[ours.rnum][k], ref_logits[k]))
                compared += 1
    assert worst < tol, f"logits differ by {worst:.3g} of their std (limit {tol:g})"
    assert got.logits is None or compared >= len(reference.requests)  # each request's first


# -- triton attention against the torch reference ----------------------------------------------


@pytest.mark.parametrize(("dtype", "tol"), [("bfloat16", 0.05), ("float16", 0.01)])
def test_triton_attention_matches_torch_over_a_mixed_batch(
    head_dim_64_dir: Path, dtype: str, tol: float
) -> None:
    """Chunked prefills (one of 300 tokens over 19 blocks) beside decodes, late arrivals."""
    prompts = [list(range(100, 163)), list(range(300, 305)), list(range(7, 40)), [42]]
    prompts.append([(17 * i) % 40000 + 100 for i in range(300)])
    runs = {
        backend: run_greedy(
            cuda_runner(head_dim_64_dir, dtype, attention_backend=backend),
            prompts,
            8,
            chunk=32,
            arrivals=[0, 0, 2, 3, 1],
        )
        for backend in ("torch", "triton")
    }
    assert runs["triton"].logits is not None
    compare_runs(runs["torch"], runs["triton"], tie=TIE_HALF, tol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_cases_of_the_interpreter_tests_run_compiled(dtype: torch.dtype) -> None:
    """test_attention_triton.py's cases (mixed, head_dim 128, split-KV decodes) on CUDA."""
    cases = pytest.importorskip("tests.gpu.test_attention_triton")
    step = getattr(cases, "Step", None)
    if step is None:
        pytest.skip("test_attention_triton.py has no Step")
    for seqs, heads, kv_heads, head_dim, segments in [
        ([(20, 1), (0, 25), (40, 9)], 6, 2, 64, None),
        ([(150, 1), (37, 60), (0, 130)], 4, 2, 128, None),
        ([(300, 1), (5, 1), (129, 1)], 8, 2, 64, 4),
        ([(300, 1), (5, 1), (129, 1)], 8, 2, 64, 16),
    ]:
        case = step(seqs, heads, kv_heads, head_dim=head_dim, dtype=dtype)
        out_err, cache_err = case.run(segments, device="cuda")
        assert cache_err == 0.0, seqs
        assert out_err < 2e-2, seqs  # one rounding of outputs of magnitude about 1


# -- against transformers, in float32 ----------------------------------------------------------


def transformers_greedy(
    hf: torch.nn.Module, prompt: list[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for `prompt` on CUDA, and each step's raw logits."""
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(  # type: ignore[operator]
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [s[0].float().cpu() for s in out.logits]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_tokens_equal_transformers_on_cuda_batched_and_alone(
    tiny_dir: Path, backend: str
) -> None:
    prompts = [list(range(50, 50 + n)) for n in (3, 17, 9, 1, 30, 12, 5, 21)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    reference = [transformers_greedy(hf, p, 12) for p in prompts]
    runner = cuda_runner(tiny_dir, "float32", attention_backend=backend)
    batched = run_greedy(runner, prompts, 12).requests
    alone = [
        run_greedy(runner, [p], 12, first_rnum=100 + i).requests[0] for i, p in enumerate(prompts)
    ]
    agreed = 0
    for i, (tokens, logits) in enumerate(reference):
        agreed += agreeing_prefix(batched[i].output, tokens, logits, TIE_FP32, f"{i} batched")
        agreed += agreeing_prefix(alone[i].output, tokens, logits, TIE_FP32, f"{i} alone")
    assert agreed >= 0.9 * 2 * 12 * len(prompts)


# -- CUDA graphs against eager -----------------------------------------------------------------


@pytest.mark.parametrize("batch", [3, 5])  # padded to the captured sizes 4 and 8
@pytest.mark.parametrize(
    ("dtype", "tie", "tol"), [("float32", TIE_FP32, 1e-3), ("bfloat16", TIE_HALF, 0.05)]
)
def test_cuda_graph_replay_gives_the_eager_tokens(
    head_dim_64_dir: Path, batch: int, dtype: str, tie: float, tol: float
) -> None:
    prompts = [list(range(60 + 50 * i, 70 + 77 * i)) for i in range(batch)]  # 10 to 118 tokens
    eager = run_greedy(cuda_runner(head_dim_64_dir, dtype), prompts, 16)
    runner = cuda_runner(head_dim_64_dir, dtype, graphs=True)
    replayed = run_greedy(runner, prompts, 16)
    assert runner.graphs is not None and runner.graphs.graphs[8 if batch > 4 else 4] is not None
    replays = runner.graphs.num_runs
    assert replays >= 15, f"{replays} graph replays in 15 pure decode steps"
    compare_runs(eager, replayed, tie=tie, tol=tol)


def ahead_steps(prompts: list[list[int]], decodes: int) -> list[StepBatch]:
    """The prompts in one step, then `decodes` steps of one token each, every request with
    the blocks it needs from the start: valid both synchronously and scheduled ahead (a
    decode's computed count is the same whether the last token is known or a placeholder).
    Seeded sampling: a tiny random model's greedy text repeats one token, which a wrong
    input id would not change; the draws of a wrong id's logits would."""
    blocks_each = (max(map(len, prompts)) + decodes) // 16 + 1
    new = [
        NewRequest(
            i + 1,
            p,
            list(range(i * blocks_each, (i + 1) * blocks_each)),
            0,
            SamplingOptions(temperature=1.0, seed=i, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    rnums = np.arange(1, len(prompts) + 1, dtype=np.uint64)
    first = StepBatch(0, new_requests=new)
    first.scheduled_rnums = rnums
    first.num_scheduled_tokens = np.array([len(p) for p in prompts], np.int32)
    batches = [first]
    for k in range(1, decodes + 1):
        step = StepBatch(k)
        step.cached_rnums = rnums
        step.cached_new_block_ids = [[] for _ in prompts]
        step.cached_num_computed = np.array([len(p) + k - 1 for p in prompts], np.int32)
        step.scheduled_rnums = rnums
        step.num_scheduled_tokens = np.ones(len(prompts), np.int32)
        batches.append(step)
    return batches


@pytest.mark.parametrize("graphs", [False, True])
def test_steps_ahead_on_cuda_give_the_synchronous_tokens(
    head_dim_64_dir: Path, graphs: bool
) -> None:
    """`execute_ahead` on CUDA (async scheduling): each decode's input id is copied on the
    device from the step in flight's sampled tokens (into the graph's static ids when
    replayed), its output read later through pinned memory and an event; the tokens equal
    the synchronous runner's, step for step."""
    prompts = [list(range(60 + 50 * i, 70 + 57 * i)) for i in range(3)]  # 10, 17, 24 tokens
    assert all(prompts)
    sync = cuda_runner(head_dim_64_dir, "float32", graphs=graphs)
    expected = [sync.execute(b).token_ids.tolist() for b in ahead_steps(prompts, 12)]
    runner = cuda_runner(head_dim_64_dir, "float32", graphs=graphs)
    pending = None
    got = []
    for batch in ahead_steps(prompts, 12):
        ahead = runner.execute_ahead(batch)  # runs before the last step's tokens are read
        if pending is not None:
            got.append(pending.result().token_ids.tolist())
        pending = ahead
    assert pending is not None
    got.append(pending.result().token_ids.tolist())
    assert got == expected
    if graphs:
        assert runner.graphs is not None and runner.graphs.num_runs >= 11
