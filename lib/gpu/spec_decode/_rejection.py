"""Verifying draft tokens so that the output keeps the target model's distribution exactly.

Leviathan et al. (2023) and Chen et al. (2023): draft token d at a position, drawn from the
draft distribution q, is accepted with probability min(1, p(d) / q(d)), p the target's
distribution there (after every sampling option: penalties over the tokens before it, logit
bias, temperature, top-k/p, min-p, the grammar's mask); on rejection the token is drawn from
norm(max(p - q, 0)) and the step ends; if every draft is accepted, one more token is drawn
from the target's distribution after the last one (the bonus). Each emitted token is then
distributed exactly as if the target had sampled it alone.

trillm's proposers are deterministic (n-gram lookup, a draft model's argmax): q is a point
mass on d. Then "accept with probability p(d), else draw from p without d" is the same law
as "draw x from p; accept d if x == d, else emit x", which `accepted_counts` implements over
tokens the ordinary sampler drew at every position. That form draws exactly one token per
emitted token from each request's generator, so a seeded request gives the same tokens with
and without speculation (the runner rewinds what the positions after a rejection drew), and
greedy rows (argmax) give the same tokens by construction. `rejection_sample` is the general
form, for a draft that samples (q not a point mass); the tests check both against the
target's distribution (chi-square on a small vocabulary).
"""

from __future__ import annotations

import numpy as np
import torch

# Exp(1) noise is clamped away from 0 (probs 0 / noise 0 would be NaN, which argmax picks).
_TINY = torch.finfo(torch.float32).tiny


def accepted_counts(sampled: np.ndarray, drafts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """How many drafts each row accepts, for point-mass drafts.

    Row r verified the drafts `drafts[offsets[r]:offsets[r + 1]]` (k_r of them) and sampled
    k_r + 1 tokens, at `sampled[offsets[r] + r : offsets[r + 1] + r + 1]`: position j's token
    was drawn from the target's distribution given the drafts before j. The row accepts the
    drafts up to the first position whose sampled token differs; it emits the accepted
    drafts and then the token sampled after them (n_r + 1 tokens, `sampled`'s first n_r + 1
    of the row, since an accepted draft equals its sampled token).

    Args:
        sampled: int [sum(k_r + 1)] tokens sampled at every position, rows consecutive.
        drafts: int [sum(k_r)].
        offsets: int [rows + 1], each row's start in `drafts`.

    Returns:
        int64 [rows]: n_r, the accepted drafts of each row (0 <= n_r <= k_r).
    """
    counts = np.diff(offsets).astype(np.int64)
    rows = len(counts)
    if not len(drafts):
        return np.zeros(rows, np.int64)
    starts = offsets[:-1].astype(np.int64) + np.arange(rows)  # each row's first in `sampled`
    row_of = np.repeat(np.arange(rows), counts)
    position = np.arange(len(drafts)) - offsets[:-1].astype(np.int64)[row_of]
    mismatch = sampled[starts[row_of] + position] != drafts
    # The first mismatch of each row, or k_r when there is none.
    first = np.where(mismatch, position, counts[row_of])
    accepted = counts.copy()
    np.minimum.at(accepted, row_of, first)
    return accepted


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan's rejection sampling over a batch of rows with k drafts each.

    Args:
        target_probs: [B, k + 1, V] the target's distribution at each draft's position and
            after the last (the bonus).
        draft_probs: [B, k, V] the distribution each draft was drawn from; None: point
            masses on `draft_tokens` (a greedy or n-gram draft).
        draft_tokens: [B, k] int64.
        generator: the source of the uniforms and of the recovered and bonus draws.

    Returns:
        (tokens [B, k + 1] int64, -1 past each row's end; num_emitted [B] int64 in 1..k+1).
    """
    rows, k = draft_tokens.shape
    index = draft_tokens.unsqueeze(-1)
    p = target_probs[:, :k]
    p_draft = p.gather(-1, index).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = p.scatter(-1, index, 0.0)
    else:
        q_draft = draft_probs.gather(-1, index).squeeze(-1)
        residual = (p - draft_probs).clamp_min_(0.0)
    uniform = torch.rand(p_draft.shape, generator=generator, device=p.device)
    accept = uniform * q_draft < p_draft  # u < p(d) / q(d), without dividing by q(d) = 0
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # leading accepts
    # Where p == q no rejection can happen, and the residual is all zero: never read then.
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(_TINY), p)
    choices = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k + 1, V]
    last = choices[torch.arange(rows, device=p.device), num_accepted]  # [B, V]
    noise = torch.empty_like(last).exponential_(generator=generator).clamp_min_(_TINY)
    final = (last / noise).argmax(dim=-1)
    tokens = torch.full((rows, k + 1), -1, dtype=torch.int64, device=p.device)
    keep = torch.arange(k, device=p.device) < num_accepted.unsqueeze(1)
    tokens[:, :k] = torch.where(keep, draft_tokens, -1)
    tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return tokens, num_accepted + 1
