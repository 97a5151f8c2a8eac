"""The sampler: from a step's logits to its tokens (and logprobs), vectorised over the batch.

Order of processing (as vLLM V1):

1. logprobs are taken from the raw logits, the log_softmax of the model's output before any
   of the steps below: they describe the model, not the sampling options;
2. logit_bias is added; EOS and stop_token_ids are set to -inf for rows below min_tokens;
3. penalties: repetition (prompt and output tokens; logits > 0 divided by it, logits <= 0
   multiplied), then frequency (times the output count) and presence (output tokens) are
   subtracted;
4. greedy rows take the exact argmax of these logits (torch.argmax, first index on ties);
5. random rows: temperature, top-k, top-p, min-p, then one draw: argmax(probs / E) with E
   i.i.d. Exp(1), which picks token i with probability probs[i]. A seeded row draws its E from
   its own generator, so its tokens depend only on its seed and its logits, not on the batch.

The caller's logits are never written to.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._sampling_batch import LogitEdits, PenaltyRows, RandomRows, SamplingBatch

# Exp(1) noise is clamped away from 0: probs 0 / noise 0 would be NaN, which argmax picks.
_TINY = torch.finfo(torch.float32).tiny


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
        if batch.random is None:
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = _sample(processed, batch.random)
        if batch.max_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        return SamplerOutput(token_ids, *compute_logprobs(raw, token_ids, batch.max_logprobs))


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
        _add_at(logits, batch.logit_bias)
    if batch.min_tokens_mask is not None:
        _add_at(logits, batch.min_tokens_mask)
    if batch.penalties is not None:
        logits = _apply_penalties(logits, batch.penalties, owned=owned)
    return logits


def _add_at(logits: torch.Tensor, edits: LogitEdits) -> None:
    if edits.values is None:
        logits[edits.rows, edits.token_ids] = -torch.inf
    else:
        logits.index_put_((edits.rows, edits.token_ids), edits.values, accumulate=True)


def _apply_penalties(logits: torch.Tensor, penalties: PenaltyRows, *, owned: bool) -> torch.Tensor:
    rows = logits if penalties.rows is None else logits[penalties.rows]
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
    logits[penalties.rows] = rows
    return logits


def _sample(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """Greedy argmax for greedy rows, a random draw for the others."""
    rows = logits if random.rows is None else logits[random.rows]
    if random.temperature is not None:
        rows = rows / random.temperature.unsqueeze(1)
    if random.top_p is not None:
        rows = _apply_top_k_top_p(rows, random.top_k, random.top_p)
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
    largest = logits.topk(max_top_k, dim=-1).values
    kth = largest.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth.masked_fill_(top_k.unsqueeze(1) > max_top_k, -torch.inf)  # rows with top_k off
    return logits.masked_fill(logits < kth, -torch.inf)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep the top_k largest, then the smallest set of those whose probability reaches top_p.

    On an ascending sort, a token is dropped when the probability of it and every smaller
    token is <= 1 - top_p, i.e. when the larger tokens already reach top_p; the largest is
    always kept.
    """
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = ascending.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth, -torch.inf)
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    ascending.masked_fill_(drop, -torch.inf)
    return torch.empty_like(ascending).scatter_(-1, order, ascending)
