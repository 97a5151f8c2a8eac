"""Speculative decoding in the runner: verifying a step's drafts, and proposing the next's.

A row with k drafts is scheduled k + 1 tokens: its last sampled token and the drafts, which
`write` puts in its token row past its end, so the step's flattened inputs are a short
prompt chunk. Logits come from all k + 1 positions (`logit_index`), and the ordinary sampler
samples each one with the row's options, as if the drafts before it were the row's outputs
(`position_states`: penalties and min_tokens see them; the grammar's bitmask has a row per
position). `accept` keeps each row's drafts up to the first position where the sampled
token differs, and that token (`_rejection.accepted_counts`: exact in distribution for
point-mass drafts), and rewinds seeded generators to one draw per emitted token, so a seeded
request gives the same tokens as without speculation.

After sampling, `propose` asks the proposer (n-gram lookup, or a draft model) for each
sampling row's drafts for the next step; the scheduler decides whether they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._step_batch import StepBatch
from ..runner._input_batch import InputBatch
from ..sample._sampling_state import RequestSamplingState
from ._rejection import accepted_counts


@dataclass(frozen=True)
class Accepted:
    """What a verify step emits: per sampling row, its tokens' indices into the sampled
    positions (accepted drafts, then the token after them)."""

    token_index: np.ndarray  # [emitted] int64 into the step's sampled positions
    token_offsets: np.ndarray  # [rows + 1] int32
    num_accepted: np.ndarray  # [rows] int64: drafts accepted per row


class StepDrafts:
    """The drafts a step verifies, by scheduled row (`StepBatch.draft_offsets`)."""

    def __init__(self, batch: StepBatch) -> None:
        self.offsets = batch.draft_offsets.astype(np.int64)
        self.tokens = batch.draft_token_ids
        self.counts = np.diff(self.offsets)

    @staticmethod
    def of(batch: StepBatch) -> StepDrafts | None:
        """The step's drafts, or None when it verifies none."""
        if not len(batch.draft_token_ids):
            return None
        return StepDrafts(batch)

    def write(self, inputs: InputBatch, rnums: np.ndarray) -> None:
        """Put each row's drafts in its token row after its last token (not counted in
        `num_tokens`: accepted ones are appended over them after sampling)."""
        for i in np.flatnonzero(self.counts).tolist():
            row = inputs.row_of[int(rnums[i])]
            end = int(inputs.num_tokens[row])
            inputs.token_ids[row, end : end + int(self.counts[i])] = self.tokens[
                self.offsets[i] : self.offsets[i + 1]
            ]

    def positions(self, sampling: np.ndarray) -> np.ndarray:
        """Positions each sampling row samples (its drafts + 1)."""
        positions: np.ndarray = self.counts[sampling] + 1
        return positions

    def logit_index(self, sampling: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Indices into the step's hidden states of every position the rows `sampling`
        (whose last tokens are at `last`) sample: their last k + 1 tokens, in order."""
        per_row = self.positions(sampling)
        total = int(per_row.sum())
        firsts = np.repeat(last - per_row + 1 - (np.cumsum(per_row) - per_row), per_row)
        return firsts + np.arange(total)

    def position_states(
        self, sampling: np.ndarray, states: Sequence[RequestSamplingState]
    ) -> list[RequestSamplingState]:
        """The sampling state of every sampled position: the row's own, or, where the
        history matters (penalties, min_tokens not yet reached), a copy whose outputs
        include the drafts before the position."""
        expanded: list[RequestSamplingState] = []
        for i, state in zip(sampling.tolist(), states, strict=True):
            k = int(self.counts[i])
            options = state.options
            history = options.needs_penalties or (options.min_tokens > len(state.output_token_ids))
            if not k or not history:
                expanded.extend([state] * (k + 1))
                continue
            drafts = self.tokens[self.offsets[i] : self.offsets[i + 1]].tolist()
            expanded.append(state)
            expanded.extend(state.with_outputs(drafts[: j + 1]) for j in range(k))
        return expanded

    def seeded_states(
        self, sampling: np.ndarray, states: Sequence[RequestSamplingState]
    ) -> list[tuple[int, torch.Generator, torch.Tensor]]:
        """(row among `sampling`, generator, its state now) of each seeded random row with
        drafts: `accept` rewinds them."""
        return [
            (j, state.generator, state.generator.get_state())
            for j, (i, state) in enumerate(zip(sampling.tolist(), states, strict=True))
            if self.counts[i] and state.generator is not None and not state.options.is_greedy
        ]

    def accept(
        self,
        sampling: np.ndarray,
        sampled: np.ndarray,
        seeded: list[tuple[int, torch.Generator, torch.Tensor]],
        vocab_size: int,
    ) -> Accepted:
        """Each row's accepted drafts and next token, from the tokens sampled at every
        position; seeded generators rewound to one draw per emitted token (the sampler drew
        a [vocab] float32 row of Exp(1) per position, `_sampler._sample`)."""
        counts = self.counts[sampling]
        offsets = np.concatenate([[0], np.cumsum(counts)])
        drafts = np.concatenate(
            [self.tokens[self.offsets[i] : self.offsets[i + 1]] for i in sampling.tolist()]
        )
        num_accepted = accepted_counts(sampled, drafts, offsets)
        emitted = num_accepted + 1
        starts = offsets[:-1] + np.arange(len(counts))  # each row's first sampled position
        token_offsets = np.concatenate([[0], np.cumsum(emitted)]).astype(np.int32)
        token_index = np.repeat(starts - token_offsets[:-1], emitted) + np.arange(
            int(token_offsets[-1])
        )
        for j, generator, state in seeded:
            generator.set_state(state)
            scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
            for _ in range(int(emitted[j])):
                scratch.exponential_(generator=generator)
        return Accepted(token_index, token_offsets, num_accepted)
