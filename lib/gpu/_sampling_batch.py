"""The per-step vectorised batch of the rows being sampled, built from their states.

A step's rows rarely use more than a few of the sampling options, so the batch holds tensors
only for the options some row uses: a batch of plain greedy rows is an empty record and the
sampler does one argmax. `SamplingBatch.build` costs O(batch) Python per step plus, for
penalised rows, O(tokens appended since the last step) (see `RequestSamplingState`). It never
waits for the device: its decisions are made on host data and its tensors reach the device in
one non-blocking copy from pinned memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ._pinned import HostStaging
from ._sampling_state import RequestSamplingState as RequestSamplingState
from ._sampling_state import TokenIdOutOfVocabError as TokenIdOutOfVocabError


@dataclass(frozen=True, slots=True)
class RandomRows:
    """The rows sampled at random (temperature > 0), and the options they use.

    Tensors are indexed by position among the random rows; None means the option is off for
    every one of them, so the sampler skips it.
    """

    rows: torch.Tensor | None  # [R] int64 batch rows; None when every row is random
    temperature: torch.Tensor | None  # [R] float32; None when all are 1
    top_k: torch.Tensor | None  # [R] int64 in [1, V]; V for rows with top_k off
    max_top_k: int  # the largest top_k of the rows that set one
    top_p: torch.Tensor | None  # [R] float32; 1 for rows with top_p off
    top_p_rows_set_top_k: bool  # every row with top_p on also sets a top_k
    log_min_p: torch.Tensor | None  # [R] float32; -inf for rows with min_p off
    seeded: tuple[tuple[int, torch.Generator], ...]  # (position among random rows, generator)
    all_seeded: bool


@dataclass(frozen=True, slots=True)
class LogitEdits:
    """Sparse per-token edits of a [B, V] tensor viewed flat: add `values` (or -inf) there."""

    flat_index: torch.Tensor  # [N] int64: row * V + token id
    values: torch.Tensor | None  # [N] float32; None means mask to -inf


@dataclass(frozen=True, slots=True)
class PenaltyRows:
    """The rows with presence, frequency or repetition penalties, and their token counts."""

    rows: torch.Tensor | None  # [P] int64 batch rows; None when every row is penalised
    output_counts: torch.Tensor  # [P, V] float32: occurrences of each token in the output
    prompt_mask: torch.Tensor | None  # [P, V] bool: in the prompt; None if no repetition penalty
    repetition: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    presence: torch.Tensor  # [P] float32


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
        non-blocking copy from pinned memory (see `HostStaging`).

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
        random_rows: list[int] = []
        bias_rows: list[int] = []
        penalty_rows: list[int] = []
        masked_rows: list[int] = []
        masked_ids: list[npt.NDArray[np.int64]] = []
        max_logprobs: int | None = None
        for i, row in enumerate(rows):
            options = row.options
            if not options.is_greedy:
                random_rows.append(i)
            if options.logit_bias or options.min_tokens or options.needs_penalties:
                row.check_token_ids(vocab_size)
                if options.logit_bias:
                    bias_rows.append(i)
                if options.needs_penalties:
                    penalty_rows.append(i)
                if options.min_tokens:
                    ids = row.min_tokens_masked_ids(eos_token_id)
                    if ids is not None and ids.size:
                        masked_rows.append(i)
                        masked_ids.append(ids)
            k = options.logprobs
            if k is not None and (max_logprobs is None or k > max_logprobs):
                max_logprobs = k
        staging = HostStaging()
        random = _stage_random_rows(rows, random_rows, vocab_size, staging) if random_rows else None
        bias = _stage_logit_bias(rows, bias_rows, vocab_size, staging) if bias_rows else None
        masked = (
            _stage_token_edits(masked_rows, masked_ids, None, vocab_size, staging)
            if masked_rows
            else None
        )
        penalties = (
            _stage_penalty_rows(rows, penalty_rows, vocab_size, staging, device)
            if penalty_rows
            else None
        )
        staging.upload(device)
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            random=None if random is None else random(),
            logit_bias=None if bias is None else bias(),
            min_tokens_mask=None if masked is None else masked(),
            penalties=None if penalties is None else penalties(),
            max_logprobs=max_logprobs,
        )


# Each _stage_* puts its group's host arrays in the staging buffer and returns the function
# that, once the buffer is uploaded, makes the group's record from the device tensors.


def _stage_random_rows(
    rows: Sequence[RequestSamplingState],
    indices: list[int],
    vocab_size: int,
    staging: HostStaging,
) -> Callable[[], RandomRows]:
    options = [rows[i].options for i in indices]
    top_ks = [min(o.top_k, vocab_size) if o.top_k > 0 else 0 for o in options]
    max_top_k = max(top_ks)
    generators = [rows[i].generator for i in indices]
    seeded = tuple((j, g) for j, g in enumerate(generators) if g is not None)
    row_slot = _stage_rows(indices, len(rows), staging)
    temperature = None
    if any(o.temperature != 1.0 for o in options):
        temperature = staging.add(np.array([o.temperature for o in options], np.float32))
    top_k = None
    if max_top_k:
        top_k = staging.add(np.array([k or vocab_size for k in top_ks], np.int64))
    top_p = None
    if any(o.top_p < 1.0 for o in options):
        top_p = staging.add(np.array([min(o.top_p, 1.0) for o in options], np.float32))
    log_min_p = None
    if any(o.min_p > 0.0 for o in options):
        log_min_p = staging.add(
            np.array(
                [math.log(o.min_p) if o.min_p > 0.0 else -math.inf for o in options], np.float32
            )
        )

    def finish() -> RandomRows:
        return RandomRows(
            rows=_uploaded(staging, row_slot),
            temperature=_uploaded(staging, temperature),
            top_k=_uploaded(staging, top_k),
            max_top_k=max_top_k,
            top_p=_uploaded(staging, top_p),
            top_p_rows_set_top_k=all(o.top_k > 0 for o in options if o.top_p < 1.0),
            log_min_p=_uploaded(staging, log_min_p),
            seeded=seeded,
            all_seeded=len(seeded) == len(indices),
        )

    return finish


def _stage_logit_bias(
    rows: Sequence[RequestSamplingState], indices: list[int], vocab_size: int, staging: HostStaging
) -> Callable[[], LogitEdits]:
    states = [rows[i] for i in indices]
    values = np.concatenate([s._bias_values for s in states])
    token_ids = [s._bias_token_ids for s in states]
    return _stage_token_edits(indices, token_ids, values, vocab_size, staging)


def _stage_token_edits(
    indices: list[int],
    token_ids: list[npt.NDArray[np.int64]],
    values: npt.NDArray[np.float32] | None,
    vocab_size: int,
    staging: HostStaging,
) -> Callable[[], LogitEdits]:
    flat_index = staging.add(_flat_index(token_ids, vocab_size, indices))
    value_slot = None if values is None else staging.add(values)
    return lambda: LogitEdits(staging[flat_index], _uploaded(staging, value_slot))


def _stage_penalty_rows(
    rows: Sequence[RequestSamplingState],
    indices: list[int],
    vocab_size: int,
    staging: HostStaging,
    device: torch.device,
) -> Callable[[], PenaltyRows]:
    states = [rows[i] for i in indices]
    options = [s.options for s in states]
    output_index = staging.add(_flat_index([s.output_token_array() for s in states], vocab_size))
    repetition = np.array([o.repetition_penalty for o in options], np.float32)
    prompt_index = None
    if (repetition != 1.0).any():
        prompt_index = staging.add(_flat_index([s.prompt_token_ids for s in states], vocab_size))
    row_slot = _stage_rows(indices, len(rows), staging)
    repetition_slot = staging.add(repetition)
    frequency = staging.add(np.array([o.frequency_penalty for o in options], np.float32))
    presence = staging.add(np.array([o.presence_penalty for o in options], np.float32))
    shape = (len(states), vocab_size)

    def finish() -> PenaltyRows:
        output_counts = torch.zeros(shape, dtype=torch.float32, device=device)
        index = staging[output_index]
        ones = torch.ones(index.shape, dtype=torch.float32, device=device)
        output_counts.view(-1).index_add_(0, index, ones)
        prompt_mask = None
        if prompt_index is not None:
            prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
            prompt_mask.view(-1).index_fill_(0, staging[prompt_index], True)
        return PenaltyRows(
            rows=_uploaded(staging, row_slot),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            repetition=staging[repetition_slot],
            frequency=staging[frequency],
            presence=staging[presence],
        )

    return finish


def _stage_rows(indices: list[int], num_rows: int, staging: HostStaging) -> int | None:
    """Stage a group's batch rows; None (no tensor) when the group is the whole batch."""
    if len(indices) == num_rows:
        return None
    return staging.add(np.array(indices, np.int64))


def _uploaded(staging: HostStaging, slot: int | None) -> torch.Tensor | None:
    return None if slot is None else staging[slot]


def _flat_index(
    token_ids: Sequence[npt.NDArray[np.int32] | npt.NDArray[np.int64]],
    vocab_size: int,
    rows: Sequence[int] | None = None,
) -> npt.NDArray[np.int64]:
    """Indices into a [B, vocab_size] tensor viewed flat: row * V + token, where row i's
    tokens are token_ids[i] and rows[i] its row (i itself when rows is None)."""
    lengths = [len(ids) for ids in token_ids]
    row_ids = (
        np.arange(len(token_ids), dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    )
    row_offsets = np.repeat(row_ids * vocab_size, lengths)
    return row_offsets + np.concatenate(token_ids).astype(np.int64, copy=False)
