"""Rejection sampling keeps the target's distribution (private module `_rejection`).

Chi-square tests on an 8-token vocabulary at fixed seeds: the first emitted token must follow
the target's distribution at the first position, and the second (present when the first
draft was accepted) the target's at the second. A bound of 30 with 7 degrees of freedom is
passed by chance with probability 1 - 1e-4 by a right implementation; the wrong variants
below score in the hundreds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from trillm.common.wire import SamplingOptions
from trillm.gpu.sample._sampler import Sampler
from trillm.gpu.sample._sampling_batch import RequestSamplingState, SamplingBatch
from trillm.gpu.spec_decode._rejection import accepted_counts, rejection_sample

V, K, N = 8, 2, 20_000
CHI2_BOUND = 30.0  # df 7: P(chi2 > 30) is about 1e-4
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fixed_seed() -> Iterator[None]:
    torch.manual_seed(1234)
    yield


def chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * len(samples)
    seen = expected > 0
    assert observed[~seen].sum() == 0, "a token the target cannot emit was emitted"
    return float(((observed[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def target() -> torch.Tensor:
    """[K + 1, V] the target's distribution at each position, far from uniform."""
    g = torch.Generator().manual_seed(7)
    return torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, dim=-1)


def check(
    sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    expected: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
) -> tuple[float, float]:
    """chi-square of the first emitted token against p0, and of the second (where the first
    draft was accepted) against p1; `sample(p, drafts)` -> tokens [N, K + 1] (-1 past the end);
    `expected(p)`: the distribution the sampling options make of the target's."""
    p = target()
    drafts = torch.tensor([[2, 5]] * N)  # 2 is likely at position 0, 5 middling at 1
    tokens = sample(p, drafts)
    second = tokens[tokens[:, 0] == 2, 1]
    want = expected(p)
    return chi2(tokens[:, 0], want[0]), chi2(second, want[1])


def test_rejection_sample_with_a_sampling_draft_keeps_the_target_distribution() -> None:
    p = target()
    q = torch.softmax(torch.randn(K, V, generator=torch.Generator().manual_seed(3)), dim=-1)
    drawn = torch.multinomial(q.expand(N, K, V).reshape(-1, V), 1).view(N, K)
    tokens, emitted = rejection_sample(p.expand(N, K + 1, V), q.expand(N, K, V), drawn)
    assert int(emitted.min()) >= 1 and int(emitted.max()) <= K + 1
    assert chi2(tokens[:, 0], p[0]) < CHI2_BOUND
    # The second token exists where the first was accepted; given token x at position 0 the
    # target's next distribution here is p[1] whatever x was (the test's target ignores it).
    second = tokens[tokens[:, 1] >= 0, 1]
    assert chi2(second, p[1]) < CHI2_BOUND


def test_rejection_sample_with_point_mass_drafts_keeps_the_target_distribution() -> None:
    def sample(p: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        return rejection_sample(p.expand(N, K + 1, V), None, drafts)[0]

    first, second = check(sample)
    assert first < CHI2_BOUND and second < CHI2_BOUND


def test_a_wrong_rejection_sampler_fails_the_bound() -> None:
    """Resampling a rejected position from p (not from p without the draft) over-emits the
    draft token; accepting every draft emits only it. Both fail by far."""

    def accept_every_draft(p: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        q = torch.full((N, K, V), 1e-9)  # q(d) ~ 0: p(d) / q(d) > 1, every draft accepted
        return rejection_sample(p.expand(N, K + 1, V), q, drafts)[0]

    accept_all, _ = check(accept_every_draft)
    assert accept_all > 10 * CHI2_BOUND

    def wrong_residual(p: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        accept = torch.rand(N) < p[0, 2]
        redraw = torch.multinomial(p[0].expand(N, V), 1).squeeze(1)  # should exclude 2
        first = torch.where(accept, torch.tensor(2), redraw)
        second = torch.multinomial(p[1].expand(N, V), 1).squeeze(1)
        return torch.stack([first, torch.where(first == 2, second, -1)], dim=1)

    wrong_first, _ = check(wrong_residual)
    assert wrong_first > 10 * CHI2_BOUND


def engine_verify(
    options: SamplingOptions,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """What the runner does: the ordinary sampler at every position (N rows, each a request
    with drafts [2, 5]), then `accepted_counts`; returns the emitted tokens, -1 past them."""

    def sample(p: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        state = RequestSamplingState(options, np.array([1], np.int32), CPU)
        logits = p.log().repeat(N, 1)  # [N * (K + 1), V], row-major by request
        rows = [state] * (N * (K + 1))
        batch = SamplingBatch.build(rows, eos_token_id=None, vocab_size=V, device=CPU)
        sampled = Sampler()(logits, batch).token_ids.numpy()
        offsets = np.arange(N + 1) * K
        accepted = accepted_counts(sampled, drafts.numpy().reshape(-1), offsets)
        tokens = torch.from_numpy(sampled.reshape(N, K + 1).copy())
        past = torch.arange(K + 1) > torch.from_numpy(accepted).unsqueeze(1)
        return tokens.masked_fill(past, -1)

    return sample


def test_the_engine_s_verification_keeps_the_target_distribution() -> None:
    first, second = check(engine_verify(SamplingOptions(temperature=1.0)))
    assert first < CHI2_BOUND and second < CHI2_BOUND


def test_the_engine_s_verification_keeps_a_tempered_top_k_distribution() -> None:
    def tempered_top_4(p: torch.Tensor) -> torch.Tensor:
        scaled = p.log() / 0.6
        kth = scaled.topk(4, dim=-1).values[:, -1:]
        return torch.softmax(scaled.masked_fill(scaled < kth, -torch.inf), dim=-1)

    options = SamplingOptions(temperature=0.6, top_k=4)
    first, second = check(engine_verify(options), tempered_top_4)
    assert first < CHI2_BOUND and second < CHI2_BOUND


def test_accepted_counts_stop_at_the_first_mismatch_per_row() -> None:
    # Row 0: drafts [4, 5, 6], sampled [4, 5, 9, x]: accepts 2. Row 1: no drafts. Row 2:
    # drafts [1], sampled [1, 3]: accepts 1 (then the bonus 3).
    sampled = np.array([4, 5, 9, 7, 8, 1, 3])
    drafts = np.array([4, 5, 6, 1])
    offsets = np.array([0, 3, 3, 4])
    assert accepted_counts(sampled, drafts, offsets).tolist() == [2, 0, 1]
