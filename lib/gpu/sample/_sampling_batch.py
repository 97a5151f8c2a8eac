"""The per-step vectorised batch of the rows being sampled, built from their states.

A step's rows rarely use more than a few of the sampling options, so the batch holds tensors
only for the options some row uses: a batch of plain greedy rows is an empty record and the
sampler does one argmax. The batch is made from the rows' options as numpy columns
(`SamplingColumns`; the runner keeps them per row, `_sampling_rows`), so a step pays Python
only for the rows that need their request's state (logit_bias, min_tokens, penalties: plus,
for penalised rows, O(tokens appended since the last step), see `RequestSamplingState`) and
for seeded rows. `SamplingBatch.build` makes the columns from a list of states, O(batch)
Python. It never waits for the device: its decisions are made on host data and its tensors
reach the device in one non-blocking copy from pinned memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ..runner._pinned import HostStaging
from ._sampling_columns import SamplingColumns
from ._sampling_groups import (
    LogitEdits,
    PenaltyRows,
    RandomRows,
    stage_logit_bias,
    stage_penalty_rows,
    stage_random_rows,
    stage_token_edits,
)
from ._sampling_state import RequestSamplingState as RequestSamplingState
from ._sampling_state import TokenIdOutOfVocabError as TokenIdOutOfVocabError


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """The per-step vectorised view of the rows being sampled; built by `build`.

    Each group is None when no row uses it, so a batch pays only for the options in use.
    Build it every step (its cost is O(batch) Python); it is immutable.
    """

    num_rows: int
    vocab_size: int
    random: RandomRows | None  # None: every row is greedy
    logit_bias: LogitEdits | None
    min_tokens_mask: LogitEdits | None  # EOS and stop ids of rows below min_tokens
    penalties: PenaltyRows | None
    max_logprobs: int | None  # the largest k asked for; None when no row wants logprobs

    @property
    def all_greedy(self) -> bool:
        return self.random is None

    @property
    def any_top_k(self) -> bool:
        return self.random is not None and self.random.top_k is not None

    @property
    def any_top_p(self) -> bool:
        return self.random is not None and self.random.top_p is not None

    @property
    def any_min_p(self) -> bool:
        return self.random is not None and self.random.log_min_p is not None

    @property
    def any_seeded(self) -> bool:
        return self.random is not None and bool(self.random.seeded)

    @property
    def any_logit_bias(self) -> bool:
        return self.logit_bias is not None

    @property
    def any_min_tokens(self) -> bool:
        return self.min_tokens_mask is not None

    @property
    def any_penalties(self) -> bool:
        return self.penalties is not None

    @classmethod
    def build(
        cls,
        rows: Sequence[RequestSamplingState],
        *,
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        """Gather this step's rows into tensors on `device`, without waiting for the device.

        Every decision is made on host data; the tensors reach the device in one
        non-blocking copy from pinned memory (see `HostStaging`). O(batch) Python: the model
        runner's steps go through `SamplingRows`' columns instead.

        Args:
            rows: the requests sampled this step, in the order of the logits' rows.
            eos_token_id: masked (with stop_token_ids) for rows below min_tokens.
            vocab_size: the logits' last dimension.
            device: where the logits live.

        Returns:
            The batch, holding tensors only for the options some row uses.

        Raises:
            TokenIdOutOfVocabError: a row's logit_bias, stop or prompt ids are >= vocab_size.
        """
        return cls.from_columns(
            SamplingColumns.of(rows),
            eos_token_id=eos_token_id,
            vocab_size=vocab_size,
            device=device,
        )

    @classmethod
    def greedy(cls, num_rows: int, vocab_size: int) -> SamplingBatch:
        """The batch of rows that are all plain greedy: the sampler does one argmax."""
        return cls(num_rows, vocab_size, None, None, None, None, None)

    @classmethod
    def from_columns(
        cls,
        columns: SamplingColumns,
        *,
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        """`build` from the rows' options as columns: numpy over the batch, and Python only
        over the rows in `columns.special` and `columns.seeded` (arguments as `build`'s)."""
        num_rows = columns.num_rows
        bias_rows: list[int] = []
        penalty_rows: list[int] = []
        masked_rows: list[int] = []
        masked_ids: list[npt.NDArray[np.int64]] = []
        states: dict[int, RequestSamplingState] = {}
        for i, row in columns.special:
            options = row.options
            row.check_token_ids(vocab_size)
            states[i] = row
            if options.logit_bias:
                bias_rows.append(i)
            if options.needs_penalties:
                penalty_rows.append(i)
            if options.min_tokens:
                ids = row.min_tokens_masked_ids(eos_token_id)
                if ids is not None and ids.size:
                    masked_rows.append(i)
                    masked_ids.append(ids)
        k = -1 if columns.logprobs is None else int(columns.logprobs.max(initial=-1))
        random_rows = None if columns.random is None else np.flatnonzero(columns.random)
        staging = HostStaging()
        random = (
            stage_random_rows(columns, random_rows, vocab_size, staging)
            if random_rows is not None and len(random_rows)
            else None
        )
        bias = stage_logit_bias(states, bias_rows, vocab_size, staging) if bias_rows else None
        masked = (
            stage_token_edits(masked_rows, masked_ids, None, vocab_size, staging)
            if masked_rows
            else None
        )
        penalties = (
            stage_penalty_rows(states, penalty_rows, num_rows, vocab_size, staging, device)
            if penalty_rows
            else None
        )
        staging.upload(device)
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            random=None if random is None else random(),
            logit_bias=None if bias is None else bias(),
            min_tokens_mask=None if masked is None else masked(),
            penalties=None if penalties is None else penalties(),
            max_logprobs=None if k < 0 else k,
        )
