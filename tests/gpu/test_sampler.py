"""Unit tests of the sampler (private modules `_sampler`, `_sampling_batch`) on CPU tensors."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.common.wire import SamplingOptions
from trillm.gpu.sample._sampler import (
    Sampler,
    _apply_top_k,
    _process_logits,
    _top_p_among_top_k,
    _top_p_by_bisection,
    _top_p_by_sort,
    compute_logprobs,
)
from trillm.gpu.sample._sampling_batch import (
    RequestSamplingState,
    SamplingBatch,
    TokenIdOutOfVocabError,
)

CPU = torch.device("cpu")
sampler = Sampler()


@pytest.fixture(autouse=True, scope="module")
def one_thread_and_a_fixed_seed() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads, and on a loaded machine each
    parallel softmax can wait a scheduler tick for its second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the support tests draw thousands of samples; make them repeatable
    yield
    torch.set_num_threads(threads)


def state(prompt: tuple[int, ...] = (), **options: Any) -> RequestSamplingState:
    return RequestSamplingState(SamplingOptions(**options), np.array(prompt, np.int32), CPU)


def build(
    rows: list[RequestSamplingState], vocab_size: int, eos: int | None = None
) -> SamplingBatch:
    return SamplingBatch.build(rows, eos_token_id=eos, vocab_size=vocab_size, device=CPU)


def support(logits: torch.Tensor, n: int = 4000, **options: Any) -> set[int]:
    """The tokens drawn in n samples of one row's logits with these options."""
    rows = [state(**options)] * n
    out = sampler(logits.expand(n, -1).contiguous(), build(rows, logits.shape[-1]))
    return set(out.token_ids.tolist())


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# --- greedy ---------------------------------------------------------------------------------


def test_plain_greedy_batch_builds_no_optional_tensors() -> None:
    batch = build([state(temperature=0.0) for _ in range(4)], 100)
    assert batch.all_greedy
    assert not (batch.any_top_k or batch.any_top_p or batch.any_min_p or batch.any_seeded)
    assert not (batch.any_penalties or batch.any_logit_bias or batch.any_min_tokens)
    assert batch.random is batch.logit_bias is batch.min_tokens_mask is batch.penalties is None
    assert batch.max_logprobs is None


def test_plain_random_batch_builds_only_what_is_used() -> None:
    batch = build([state(temperature=1.0), state(temperature=1.0, top_p=0.9)], 100)
    assert batch.random is not None and not batch.all_greedy
    assert batch.random.rows is None and batch.random.temperature is None
    assert batch.any_top_p and not (batch.any_top_k or batch.any_min_p or batch.any_seeded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_torch_argmax_including_ties(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[3, [7, 500]] = 50.0  # a tie: torch.argmax takes the first index
    out = sampler(logits, build([state(temperature=0.0) for _ in range(16)], 1000))
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.token_ids[3] == 7
    assert out.logprobs is out.topk_ids is out.topk_logprobs is None


def test_greedy_and_random_rows_mixed_in_one_batch() -> None:
    vocab = 8
    logits = torch.zeros(400, vocab)
    logits[:, 5] = 0.5  # greedy picks 5; random rows pick anything
    rows = [state(temperature=0.0 if i % 2 else 1.0) for i in range(400)]
    tokens = sampler(logits, build(rows, vocab)).token_ids
    assert (tokens[1::2] == 5).all()
    assert set(tokens[0::2].tolist()) == set(range(vocab))


def test_the_callers_logits_are_not_modified() -> None:
    logits = torch.randn(2, 50)
    before = logits.clone()
    rows = [
        state((1, 2), temperature=0.5, top_p=0.5, repetition_penalty=1.5, logit_bias=((3, 4),)),
        state(temperature=0.0, min_tokens=2, stop_token_ids=(4,)),
    ]
    sampler(logits, build(rows, 50, eos=0))
    assert torch.equal(logits, before)


# --- top-k, top-p, min-p --------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([0.1, 0.9, 0.3, 0.5, 0.2, 0.8, 0.0, 0.4])
    assert support(logits, top_k=3) == {1, 5, 3}
    assert support(logits, top_k=1) == {1}
    assert support(logits, top_k=100) == set(range(8))  # above the vocabulary: off


def test_top_k_rows_mixed_with_rows_without_top_k() -> None:
    logits = torch.tensor([0.1, 0.9, 0.3, 0.5, 0.2, 0.8, 0.0, 0.4]).expand(4000, -1)
    rows = [state(top_k=2), state(), state(top_k=4), state(top_p=1.0)] * 1000
    tokens = sampler(logits.contiguous(), build(rows, 8)).token_ids.view(1000, 4)
    assert set(tokens[:, 0].tolist()) == {1, 5}
    assert set(tokens[:, 1].tolist()) == set(range(8))
    assert set(tokens[:, 2].tolist()) == {1, 5, 3, 7}
    assert set(tokens[:, 3].tolist()) == set(range(8))


@pytest.mark.parametrize(
    ("probs", "top_p", "kept"),
    [
        ([0.05, 0.5, 0.15, 0.3], 0.75, {1, 3}),  # 0.5 + 0.3 reaches 0.75
        ([0.05, 0.5, 0.15, 0.3], 0.85, {1, 3, 2}),
        ([0.05, 0.5, 0.15, 0.3], 0.99, {0, 1, 2, 3}),
        ([0.02, 0.9, 0.05, 0.03], 0.5, {1}),  # the top token alone exceeds p
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(
    probs: list[float], top_p: float, kept: set[int]
) -> None:
    assert support(logits_of(probs), top_p=top_p) == kept


def test_top_k_and_top_p_together() -> None:
    logits = logits_of([0.05, 0.4, 0.15, 0.3, 0.1])
    assert support(logits, top_k=2, top_p=0.99) == {1, 3}  # top_k cuts first
    assert support(logits, top_k=4, top_p=0.5) == {1, 3}  # renormalised: 0.4/0.95 < 0.5


def test_min_p_keeps_tokens_within_min_p_of_the_max() -> None:
    logits = logits_of([0.4, 0.3, 0.15, 0.1, 0.05])
    assert support(logits, min_p=0.3) == {0, 1, 2}  # p >= 0.12
    assert support(logits, min_p=0.2) == {0, 1, 2, 3}  # p >= 0.08


def test_min_p_applies_after_temperature() -> None:
    logits = logits_of([0.4, 0.3, 0.15, 0.1, 0.05])  # at T=0.5 the probs go as p**2
    assert support(logits, temperature=0.5, min_p=0.1) == {0, 1, 2}  # 0.0225 >= 0.016


# --- penalties, logit bias, min_tokens -------------------------------------------------------


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], options: SamplingOptions
) -> list[float]:
    """vLLM's penalties, token by token."""
    result = []
    for token, value in enumerate(logits):
        count = output.count(token)
        if token in prompt or count:
            r = options.repetition_penalty
            value = value / r if value > 0 else value * r
        value -= options.frequency_penalty * count + options.presence_penalty * (count > 0)
        result.append(value)
    return result


def test_penalties_match_a_reference() -> None:
    vocab = 10
    cases = [
        ((1, 2, 2), [2, 3, 3, 3], {"repetition_penalty": 1.3}),
        ((1,), [2, 3, 3, 3], {"presence_penalty": 0.5, "frequency_penalty": 0.25}),
        ((4, 5), [5, 6, 6], {"repetition_penalty": 0.8, "frequency_penalty": -0.5}),
        ((7,), [], {"presence_penalty": 1.0, "repetition_penalty": 2.0}),
        ((), [], {}),  # an unpenalised row amid penalised ones
    ]
    rows = []
    for prompt, output, options in cases:
        row = state(prompt, **options)
        row.output_token_ids.extend(output)
        rows.append(row)
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(1))
    batch = build(rows, vocab)
    assert batch.penalties is not None and batch.penalties.rows is not None
    got = _process_logits(logits, batch)
    for i, (prompt, output, _) in enumerate(cases):
        want = reference_penalties(logits[i].tolist(), list(prompt), output, rows[i].options)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_penalty_counts_follow_appended_and_truncated_outputs() -> None:
    row = state((1,), frequency_penalty=1.0)
    logits = torch.zeros(1, 6)
    for token in (2, 2, 3):
        row.output_token_ids.append(token)
        build([row], 6)  # mirrors incrementally
    assert _process_logits(logits, build([row], 6))[0].tolist() == [0, 0, -2, -1, 0, 0]
    row.truncate_output(1)
    row.output_token_ids.append(4)
    assert _process_logits(logits, build([row], 6))[0].tolist() == [0, 0, -1, 0, -1, 0]
    row.output_token_ids.pop()  # shortened, then built before growing again: also seen
    assert _process_logits(logits, build([row], 6))[0].tolist() == [0, 0, -1, 0, 0, 0]


def test_logit_bias_is_added_to_its_rows() -> None:
    logits = torch.zeros(3, 6)
    rows = [state(logit_bias=((4, 2.5), (1, -1.0))), state(), state(logit_bias=((0, 7.0),))]
    got = _process_logits(logits, build(rows, 6))
    assert got.tolist() == [[0, -1, 0, 0, 2.5, 0], [0] * 6, [7, 0, 0, 0, 0, 0]]
    assert build(rows[1:2], 6).logit_bias is None


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    eos, stop, vocab = 5, 2, 8
    logits = torch.zeros(1, vocab)
    logits[0, eos] = 3.0
    logits[0, stop] = 2.0
    logits[0, 6] = 1.0
    row = state(temperature=0.0, min_tokens=3, stop_token_ids=(stop,), ignore_eos=ignore_eos)
    tokens = []
    for _ in range(4):
        batch = build([row], vocab, eos=eos)
        assert batch.any_min_tokens == (len(row.output_token_ids) < 3)
        tokens.append(int(sampler(logits, batch).token_ids[0]))
        row.output_token_ids.append(tokens[-1])
    assert tokens == [6, 6, 6, eos]


def test_logits_must_match_the_batch() -> None:
    with pytest.raises(
        ValueError, match=r"logits of shape \(3, 10\) do not match a batch of 2 rows"
    ):
        sampler(torch.zeros(3, 10), build([state(), state()], 10))


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(
        TokenIdOutOfVocabError, match=r"logit_bias token id 12 is outside the vocabulary \[0, 10\)"
    ):
        build([state(logit_bias=((12, 1.0),))], 10)
    with pytest.raises(TokenIdOutOfVocabError, match="prompt token id 10 is outside"):
        build([state((3, 10), repetition_penalty=1.2)], 10)


# --- seeded and unseeded sampling ------------------------------------------------------------

VOCAB = 64
STEPS = 5
SEEDED_OPTIONS: list[dict[str, Any]] = [
    {"temperature": 0.9, "seed": 1234},
    {"temperature": 0.7, "top_p": 0.9, "seed": 99},
    {"top_k": 20, "min_p": 0.05, "seed": -5, "presence_penalty": 0.5},
]
OTHER_OPTIONS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {},
    {"temperature": 1.3, "top_k": 5},
    {"top_p": 0.5},
    {"min_p": 0.2, "seed": 7},
    {"seed": 1234, "repetition_penalty": 1.2, "logit_bias": ((3, 2.0),)},
]


def step_logits(step: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step))


def run_steps(
    options: dict[str, Any], others_before: list[int], others_after: list[int]
) -> list[int]:
    """Sample STEPS tokens for a seeded row with other rows around it; its tokens."""
    row = state((1, 2, 3), **options)
    before = [state((4,), **OTHER_OPTIONS[i]) for i in others_before]
    after = [state((4,), **OTHER_OPTIONS[i]) for i in others_after]
    rows = [*before, row, *after]
    position = len(before)
    for step in range(STEPS):
        logits = torch.randn(len(rows), VOCAB)
        logits[position] = step_logits(step)
        tokens = sampler(logits, build(rows, VOCAB)).token_ids.tolist()
        for r, token in zip(rows, tokens, strict=True):
            r.output_token_ids.append(token)
    return list(row.output_token_ids)


@cache
def alone(which: int) -> list[int]:
    return run_steps(SEEDED_OPTIONS[which], [], [])


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, len(SEEDED_OPTIONS) - 1),
    before=st.lists(st.integers(0, len(OTHER_OPTIONS) - 1), max_size=6),
    after=st.lists(st.integers(0, len(OTHER_OPTIONS) - 1), max_size=6),
)
def test_seeded_row_gives_the_same_tokens_whatever_the_batch(
    which: int, before: list[int], after: list[int]
) -> None:
    assert run_steps(SEEDED_OPTIONS[which], before, after) == alone(which)


def test_different_seeds_give_different_tokens() -> None:
    runs = {tuple(run_steps({"seed": seed}, [], [])) for seed in range(8)}
    assert len(runs) > 1


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_unseeded_sampling_follows_the_distribution(temperature: float) -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    n = 20000
    logits = probs.log().expand(n, -1).contiguous()
    out = sampler(logits, build([state(temperature=temperature)] * n, 6))
    tempered = (probs.log() / temperature).softmax(dim=-1)
    assert chi_square(out.token_ids, tempered) < 25.0  # df 5: p < 1e-4 if the draw is right


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)).bfloat16()
    rows = [
        state(temperature=0.0, logprobs=0, logit_bias=((5, 30.0),)),
        state(temperature=0.7, logprobs=5, repetition_penalty=2.0),
        state(top_p=0.3),
    ]
    out = sampler(logits, build(rows, 40))
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.token_ids[0] == 5  # the bias chose the token ...
    assert out.logprobs is not None and out.topk_ids is not None and out.topk_logprobs is not None
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    top = raw.topk(5, dim=-1)  # ... but the logprobs are the model's
    assert out.topk_ids.dtype == torch.int32 and out.topk_ids.shape == (3, 5)
    assert torch.equal(out.topk_ids, top.indices.int())
    assert torch.equal(out.topk_logprobs, top.values)
    assert (out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all()


def test_logprobs_zero_gives_only_the_sampled_tokens_logprob() -> None:
    out = sampler(torch.randn(2, 10), build([state(logprobs=0), state()], 10))
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.topk_ids is None and out.topk_logprobs is None


def test_compute_logprobs_for_prompt_positions() -> None:
    logits = torch.randn(7, 30)
    targets = torch.randint(0, 30, (7,), dtype=torch.int32)
    logprobs, ids, values = compute_logprobs(logits, targets, 3)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(logprobs, raw[torch.arange(7), targets.long()])
    assert ids is not None and values is not None
    assert torch.equal(values, raw.topk(3).values)
    assert torch.equal(ids, raw.topk(3).indices.int())
    assert compute_logprobs(logits, targets, 0)[1:] == (None, None)
    with pytest.raises(ValueError, match="k must be in"):
        compute_logprobs(logits, targets, -1)


# --- top-p without a sort, against the full sort ----------------------------------------------


def sorted_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """The sampler's filter before it stopped sorting the vocabulary (the reference)."""
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = ascending.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth, -torch.inf)
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    ascending.masked_fill_(drop, -torch.inf)
    return torch.empty_like(ascending).scatter_(-1, order, ascending)


def mass_above(logits: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, V] float64: the probability after top-k of the tokens strictly larger than each
    token; and [R, V] bool: the top-k set (ties with the k-th included)."""
    values = logits.double()
    kth = values.sort(dim=-1).values.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
    in_top_k = values >= kth
    values = values.masked_fill(~in_top_k, -torch.inf)
    ascending, order = values.sort(dim=-1)
    probs = values.softmax(dim=-1).gather(1, order)
    suffix = torch.nn.functional.pad(probs.flip(-1).cumsum(-1).flip(-1), (0, 1))  # mass from i
    not_larger = torch.searchsorted(ascending, values, right=True)  # how many are <= each
    return suffix.gather(1, not_larger), in_top_k


def check_top_p(
    got: torch.Tensor,
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    tolerance: float = 1e-4,
) -> None:
    """`got` keeps the exact (float64) set and the full sort's set, but for tokens whose mass
    above is within float32 rounding of top_p, and for ties with the smallest kept token
    (kept here: the sort keeps those that happen to sort first)."""
    kept = got > -torch.inf
    above, in_top_k = mass_above(logits, top_k)
    target = top_p.double().unsqueeze(1)
    exact = in_top_k & ((above < target) | (target >= 1.0))
    reference = sorted_top_k_top_p(logits.clone(), top_k, top_p) > -torch.inf
    borderline = in_top_k & ((above - target).abs() <= tolerance)
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # ties as float32 sees them
    for name, want in (("the exact set", exact), ("the full sort", reference)):
        smallest = weights.masked_fill(~want, torch.inf).amin(dim=-1, keepdim=True)
        tie = kept & ~want & (weights == smallest)
        wrong = (kept ^ want) & ~borderline & ~tie
        assert not wrong.any(), f"differs from {name} at {wrong.nonzero().tolist()}"


@st.composite
def top_p_cases(
    draw: st.DrawFn, max_vocab: int = 300
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [R, V] float32, top_k [R] in [1, V] (V: off), top_p [R] in (0, 1])."""
    num_rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, max_vocab))
    kind = draw(st.sampled_from(["normal", "peaked", "flat", "two levels"]))
    scale = draw(st.sampled_from([0.01, 1.0, 4.0, 40.0]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    logits = torch.randn(num_rows, vocab, generator=generator) * scale
    if kind == "peaked":
        logits[:, 0] += 10.0
    elif kind == "flat":
        logits *= 1e-3
    elif kind == "two levels":
        logits = (logits > 0).float() * scale
    if draw(st.booleans()):
        logits = logits.bfloat16().float()  # many exact ties
    top_p = st.one_of(st.floats(0.01, 1.0), st.just(1.0), st.floats(0.9, 0.9999))
    top_k = st.one_of(st.just(vocab), st.integers(1, vocab))
    return (
        logits,
        torch.tensor(draw(st.lists(top_k, min_size=num_rows, max_size=num_rows))),
        torch.tensor(draw(st.lists(top_p, min_size=num_rows, max_size=num_rows))),
    )


@settings(max_examples=300, deadline=None)
@given(case=top_p_cases())
def test_top_p_by_bisection_agrees_with_the_full_sort(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    logits, top_k, top_p = case
    got = _top_p_by_bisection(_apply_top_k(logits, top_k, int(top_k.max())), top_p)
    check_top_p(got, logits, top_k, top_p)


@settings(max_examples=100, deadline=None)
@given(case=top_p_cases())
def test_top_p_by_sort_for_cuda_agrees_with_the_exact_set(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    logits, top_k, top_p = case
    got = _top_p_by_sort(_apply_top_k(logits, top_k, int(top_k.max())), top_p)
    check_top_p(got, logits, top_k, top_p)


@settings(max_examples=300, deadline=None)
@given(case=top_p_cases())
def test_top_p_among_top_k_agrees_with_the_full_sort(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    logits, top_k, top_p = case
    vocab = logits.shape[-1]
    top_k = torch.where((top_k == vocab) & (top_p < 1.0), (vocab + 1) // 2, top_k)  # top-p sets k
    set_k = top_k[top_k < vocab]  # as build: the largest top_k of the rows that set one
    max_top_k = int(set_k.max()) if len(set_k) else vocab
    check_top_p(_top_p_among_top_k(logits, top_k, max_top_k, top_p), logits, top_k, top_p)


@pytest.mark.parametrize("kind", ["normal", "peaked", "bf16"])
@pytest.mark.parametrize("vocab", [49152, 128256])
def test_top_p_agrees_with_the_full_sort_over_a_real_vocabulary(kind: str, vocab: int) -> None:
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    if kind == "peaked":
        logits[:, 7] += 12.0
    elif kind == "bf16":
        logits = logits.bfloat16().float()
    top_p = torch.tensor([0.5, 0.9, 0.999])
    no_top_k = torch.full((3,), vocab)
    got = _top_p_by_bisection(logits, top_p)
    check_top_p(got, logits, no_top_k, top_p, tolerance=1e-3)
    top_k = torch.tensor([1000, 40, 1000])
    got = _top_p_among_top_k(logits, top_k, 1000, top_p)
    check_top_p(got, logits, top_k, top_p, tolerance=1e-3)


def test_top_p_uses_the_top_k_candidates_only_when_every_top_p_row_sets_top_k() -> None:
    def top_p_rows_set_top_k(*rows: RequestSamplingState) -> bool:
        random = build(list(rows), 100).random
        assert random is not None
        return random.top_p_rows_set_top_k

    assert top_p_rows_set_top_k(state(top_k=5, top_p=0.9), state(top_k=3), state())
    assert not top_p_rows_set_top_k(state(top_k=5, top_p=0.9), state(top_p=0.5))


def test_top_p_by_bisection_separates_weights_one_float_apart() -> None:
    # Two logits whose weights exp(logit - max) are adjacent float32, the larger with its
    # lowest bit set: every bit of the threshold must be found to keep one and not the other.
    logit = torch.tensor(-1.0)
    while True:
        below = torch.nextafter(logit, torch.tensor(-2.0))
        weight, weight_below = logit.exp(), below.exp()
        bits = int(weight.view(torch.int32))
        if bits % 2 == 1 and bits - int(weight_below.view(torch.int32)) == 1:
            break
        logit = below
    logits = torch.stack([torch.tensor(0.0), logit, below]).unsqueeze(0)
    total = 1.0 + float(weight) + float(weight_below)
    top_p = torch.tensor([(1.0 + float(weight) / 2) / total])  # reached by the first two only
    kept = _top_p_by_bisection(logits, top_p) > -torch.inf
    assert kept.tolist() == [[True, True, False]]
