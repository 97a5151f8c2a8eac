"""The sampler: from a step's logits to its tokens (and logprobs), vectorised over the batch.

Order of processing (as vLLM V1):

1. logprobs are taken from the raw logits, the log_softmax of the model's output before any
   of the steps below: they describe the model, not the sampling options;
2. logit_bias is added; EOS and stop_token_ids are set to -inf for rows below min_tokens;
3. penalties: repetition (prompt and output tokens; logits > 0 divided by it, logits <= 0
   multiplied), then frequency (times the output count) and presence (output tokens) are
   subtracted;
4. greedy rows take the exact argmax of these logits (first index on ties), as `max(dim)`'s
   indices: on the CPU torch.argmax over [32, 49152] took 2.64 ms against 0.85 (one thread,
   CPU time, medians of 50), the same answer with ties and NaN;
5. random rows: temperature, top-k, top-p, min-p, then one draw: argmax(probs / E) with E
   i.i.d. Exp(1), which picks token i with probability probs[i]. A seeded row draws its E from
   its own generator, so its tokens depend only on its seed and its logits, not on the batch.

The caller's logits are never written to. Nothing here waits for the device: no value is
read back, every branch is on host data (the batch's options), sparse writes go by flat
index (index_put_ with accumulate reads the indices' range back on CUDA), and top-p needs
no sort (see `_apply_top_k_top_p`). The caller's read of the tokens is the step's one sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._sampling_batch import SamplingBatch
from ._sampling_groups import LogitEdits, PenaltyRows, RandomRows

# Exp(1) noise is clamped away from 0: probs 0 / noise 0 would be NaN, which argmax picks.
_TINY = torch.finfo(torch.float32).tiny
# Top-p looks only at the top_k largest when every top-p row sets a top_k up to this.
_MAX_TOP_P_CANDIDATES = 1024
# Bits of the top-p threshold, a float32 in [0, 1]: 1.0 is 0x3F800000 < 2**30.
_THRESHOLD_BITS = 30


class SamplerOutput(NamedTuple):
    """One step's sampled tokens and, when some row asked, their logprobs.

    k is the batch's largest requested logprobs; rows that asked for fewer ignore the
    extra columns.
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: the sampled token's logprob (raw logits)
    topk_ids: torch.Tensor | None  # [B, k] int32, most likely first
    topk_logprobs: torch.Tensor | None  # [B, k] float32


class Sampler:
    """Samples one token per row of the logits, following each row's SamplingOptions."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample a token per row.

        Args:
            logits: [B, V] float32 or bf16, row i belonging to the batch's row i; not modified.
            batch: this step's SamplingBatch (built for these rows).

        Returns:
            The tokens, and logprobs of the raw logits when batch.max_logprobs is not None.

        Raises:
            ValueError: the logits are not [batch.num_rows, batch.vocab_size].
        """
        if logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match a batch of "
                f"{batch.num_rows} rows over {batch.vocab_size} tokens; build the batch for "
                "the rows of these logits"
            )
        raw = logits.float()
        processed = _process_logits(raw, batch)
        random = batch.random
        token_ids = _greedy(processed) if random is None else _sample(processed, random)
        if batch.max_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        return SamplerOutput(token_ids, *compute_logprobs(raw, token_ids, batch.max_logprobs))


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest logit. On the CPU numpy's argmax (one SIMD pass:
    [32, 49152] float32 0.22 ms against torch's `max(dim).indices` 0.41, 2 threads:
    `perf/sampler_bench.py --batch 1,32 --vocab 49152 --repeats 51`); elsewhere torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprobs of `token_ids` and the top k, from the log_softmax of `logits` (in float32).

    Used for the sampled tokens and, by the runner, for prompt logprobs over prompt positions.

    Args:
        logits: [N, V].
        token_ids: [N] the token whose logprob is wanted at each row.
        k: how many of the most likely tokens to return per row; 0 for none.

    Returns:
        (logprobs [N] float32, top-k ids [N, k] int32, top-k logprobs [N, k] float32), the
        top-k sorted most likely first, as torch.topk; both None when k == 0.

    Raises:
        ValueError: k is negative or larger than the vocabulary.
    """
    if not 0 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [0, {logits.shape[-1]}] (the vocabulary), got {k}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprobs = logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    if k == 0:
        return token_logprobs, None, None
    top = logprobs.topk(k, dim=-1)
    return token_logprobs, top.indices.to(torch.int32), top.values


def _process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Apply logit_bias, min_tokens masking and penalties; the result is what greedy sees.

    Returns `logits` itself when nothing applies, else a new tensor: the raw logits stay
    intact for logprobs.
    """
    owned = batch.logit_bias is not None or batch.min_tokens_mask is not None
    if owned:
        logits = logits.clone()
    if batch.logit_bias is not None:
        _edit(logits, batch.logit_bias)
    if batch.min_tokens_mask is not None:
        _edit(logits, batch.min_tokens_mask)
    if batch.penalties is not None:
        logits = _apply_penalties(logits, batch.penalties, owned=owned)
    return logits


def _edit(logits: torch.Tensor, edits: LogitEdits) -> None:
    """Apply sparse edits in place; by flat index (index_put_ with accumulate would sync)."""
    flat = logits.view(-1)
    if edits.values is None:
        flat.index_fill_(0, edits.flat_index, -torch.inf)
    else:
        flat.index_add_(0, edits.flat_index, edits.values)


def _apply_penalties(logits: torch.Tensor, penalties: PenaltyRows, *, owned: bool) -> torch.Tensor:
    rows = logits if penalties.rows is None else logits.index_select(0, penalties.rows)
    counts = penalties.output_counts
    in_output = counts > 0
    if penalties.prompt_mask is not None:
        seen = penalties.prompt_mask | in_output
        scale = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)
        rows = torch.where(rows > 0, rows / scale, rows * scale)
    rows = rows - penalties.frequency.unsqueeze(1) * counts
    rows = rows - penalties.presence.unsqueeze(1) * in_output
    if penalties.rows is None:
        return rows
    if not owned:
        logits = logits.clone()
    return logits.index_copy_(0, penalties.rows, rows)


def _sample(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """Greedy argmax for greedy rows, a random draw for the others."""
    rows = logits if random.rows is None else logits.index_select(0, random.rows)
    if random.temperature is not None:
        rows = rows / random.temperature.unsqueeze(1)
    if random.top_p is not None:
        rows = _apply_top_k_top_p(rows, random.top_p, random)
    elif random.top_k is not None:
        rows = _apply_top_k(rows, random.top_k, random.max_top_k)
    if random.log_min_p is not None:
        threshold = rows.amax(dim=-1, keepdim=True) + random.log_min_p.unsqueeze(1)
        rows = rows.masked_fill(rows < threshold, -torch.inf)
    probs = rows.softmax(dim=-1)
    noise = torch.empty_like(probs)
    if not random.all_seeded:
        noise.exponential_()
    for position, generator in random.seeded:
        noise[position].exponential_(generator=generator)
    sampled = probs.div_(noise.clamp_min_(_TINY)).argmax(dim=-1)
    if random.rows is None:
        return sampled
    return logits.argmax(dim=-1).index_copy_(0, random.rows, sampled)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (and ties with the k-th); one topk, no sort."""
    kth = _kth_largest(logits.topk(max_top_k, dim=-1).values, top_k, max_top_k)
    return logits.masked_fill(logits < kth, -torch.inf)


def _kth_largest(largest: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[R, 1] each row's top_k-th largest, from its max_top_k largest; -inf where top_k is off."""
    kth = largest.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    return kth.masked_fill_(top_k.unsqueeze(1) > max_top_k, -torch.inf)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_p: torch.Tensor, random: RandomRows
) -> torch.Tensor:
    """Keep the top_k largest, then the smallest set of those whose probability reaches top_p.

    A token is kept when the probability of the tokens larger than it is below top_p: the
    largest is always kept, and so is every token tied with the smallest kept one. Neither
    path sorts the vocabulary, and neither reads a device value: the choice is host data.
    Measured on CPU (perf/sampler_bench.py, 1 thread, B 1-256, V 49152 and 128256, medians):
    top_p 0.9 alone takes 0.12-0.30x the full sort's time, with top_k 50 0.08-0.15x.
    """
    if (
        random.top_k is not None
        and random.top_p_rows_set_top_k
        and random.max_top_k <= _MAX_TOP_P_CANDIDATES
    ):
        return _top_p_among_top_k(logits, random.top_k, random.max_top_k, top_p)
    if random.top_k is not None:
        logits = _apply_top_k(logits, random.top_k, random.max_top_k)
    if logits.is_cuda:
        return _top_p_by_sort(logits, top_p)
    return _top_p_by_bisection(logits, top_p)


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p over one sort of each row, for CUDA: there a segmented sort is a few kernels
    (tens of microseconds at batch 1), while the bisection launches about 90 small ones; on
    CPU the sort is the slow one (see above). Same kept set: what lies above a token must be
    below top_p, ties with the smallest kept token kept."""
    descending = logits.sort(dim=-1, descending=True).values
    probs = descending.softmax(dim=-1)
    above = probs.cumsum(dim=-1) - probs  # mass strictly before each, in sorted order
    num_kept = (above < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = descending.gather(1, num_kept - 1)
    threshold.masked_fill_(top_p.unsqueeze(1) >= 1.0, -torch.inf)
    return logits.masked_fill(logits < threshold, -torch.inf)


def _top_p_among_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-p over each row's max_top_k largest only: the rows with top_p set a top_k.

    The probabilities are normalised over the whole top-k set (ties with the k-th beyond the
    candidates included), so the kept set is the full sort's; rows with top_p off keep
    their top-k set.
    """
    largest = logits.topk(max_top_k, dim=-1).values  # [R, K], descending
    kth = _kth_largest(largest, top_k, max_top_k)
    kept = logits.masked_fill(logits < kth, -torch.inf)
    top = largest[:, :1]
    total = (kept - top).exp_().sum(dim=-1, keepdim=True)
    weights = (largest - top).exp_().masked_fill_(largest < kth, 0.0)
    above = torch.nn.functional.pad(weights.cumsum(dim=-1)[:, :-1], (1, 0))  # mass before each
    num_kept = (above < top_p.unsqueeze(1) * total).sum(dim=-1, keepdim=True)
    threshold = largest.gather(1, num_kept.clamp_(min=1) - 1)
    threshold.masked_fill_(top_p.unsqueeze(1) >= 1.0, -torch.inf)
    return kept.masked_fill(kept < threshold, -torch.inf)


def _top_p_by_bisection(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p as a threshold: keep weights >= t, t the largest with mass(>= t) >= top_p.

    The weights exp(logit - max) lie in [0, 1], where float32 order is the order of their
    int32 bits; t's bits are found from the highest down, one reduction over [R, V] per bit,
    so t is exact after _THRESHOLD_BITS passes, the same number for every distribution.
    """
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    target = top_p.unsqueeze(1) * weights.sum(dim=-1, keepdim=True)
    # Invariant: threshold `bits` reach the target (0.0, the start, keeps everything).
    bits = torch.zeros(target.shape, dtype=torch.int32, device=logits.device)
    kept = torch.empty_like(weights)  # float, not bool: a float * bool product is slow on CPU
    for bit in reversed(range(_THRESHOLD_BITS)):
        candidate = bits + (1 << bit)
        torch.ge(weights, candidate.view(torch.float32), out=kept)
        mass = kept.mul_(weights).sum(dim=-1, keepdim=True)
        bits = torch.where(mass >= target, candidate, bits)
    threshold = bits.view(torch.float32).masked_fill_(top_p.unsqueeze(1) >= 1.0, 0.0)
    return logits.masked_fill(weights < threshold, -torch.inf)
