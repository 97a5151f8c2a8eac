"""The option groups of a step's sampling batch: their records, and the host staging of each.

Why: each group's tensors are made on the host, put in one pinned staging buffer and reach
the device in one non-blocking copy (see `HostStaging`); a group's record is made from the
device tensors once the buffer is uploaded, so `SamplingBatch.from_columns` never waits for
the device. The sampler reads the records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ..runner._pinned import HostStaging
from ._sampling_columns import SamplingColumns
from ._sampling_state import RequestSamplingState


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


# Each stage_* puts its group's host arrays in the staging buffer and returns the function
# that, once the buffer is uploaded, makes the group's record from the device tensors.


def stage_random_rows(
    columns: SamplingColumns,
    indices: npt.NDArray[np.intp],
    vocab_size: int,
    staging: HostStaging,
) -> Callable[[], RandomRows]:
    num_random = len(indices)
    seeded: tuple[tuple[int, torch.Generator], ...] = ()
    if columns.seeded:  # (position among the random rows, generator) of those with one
        at = np.searchsorted(indices, [i for i, _ in columns.seeded]).tolist()
        seeded = tuple(
            (j, g)
            for j, (i, g) in zip(at, columns.seeded, strict=True)
            if j < num_random and indices[j] == i
        )
    row_slot = _stage_rows(indices, columns.num_rows, staging)
    temperature_slot = None
    if columns.temperature is not None:
        temperature = columns.temperature[indices]
        if (temperature != 1.0).any():
            temperature_slot = staging.add(temperature.astype(np.float32))
    top_k, top_k_slot, max_top_k = None, None, 0
    if columns.top_k is not None:
        top_k = np.minimum(columns.top_k[indices], vocab_size)
        max_top_k = int(top_k.max())
        if max_top_k:
            top_k_slot = staging.add(np.where(top_k > 0, top_k, vocab_size))
    top_p_slot, top_p_rows_set_top_k = None, True
    if columns.top_p is not None:
        top_p = columns.top_p[indices]
        top_p_on = top_p < 1.0
        if top_p_on.any():
            top_p_slot = staging.add(np.minimum(top_p, 1.0).astype(np.float32))
            top_p_rows_set_top_k = top_k is not None and bool((top_k[top_p_on] > 0).all())
    log_min_p = None
    if columns.min_p is not None:
        min_p = columns.min_p[indices]
        min_p_on = min_p > 0.0
        if min_p_on.any():
            logs = np.log(np.where(min_p_on, min_p, 1.0))
            log_min_p = staging.add(np.where(min_p_on, logs, -np.inf).astype(np.float32))

    def finish() -> RandomRows:
        return RandomRows(
            rows=_uploaded(staging, row_slot),
            temperature=_uploaded(staging, temperature_slot),
            top_k=_uploaded(staging, top_k_slot),
            max_top_k=max_top_k,
            top_p=_uploaded(staging, top_p_slot),
            top_p_rows_set_top_k=top_p_rows_set_top_k,
            log_min_p=_uploaded(staging, log_min_p),
            seeded=seeded,
            all_seeded=len(seeded) == num_random,
        )

    return finish


def stage_logit_bias(
    rows: Mapping[int, RequestSamplingState],
    indices: list[int],
    vocab_size: int,
    staging: HostStaging,
) -> Callable[[], LogitEdits]:
    states = [rows[i] for i in indices]
    values = np.concatenate([s._bias_values for s in states])
    token_ids = [s._bias_token_ids for s in states]
    return stage_token_edits(indices, token_ids, values, vocab_size, staging)


def stage_token_edits(
    indices: list[int],
    token_ids: list[npt.NDArray[np.int64]],
    values: npt.NDArray[np.float32] | None,
    vocab_size: int,
    staging: HostStaging,
) -> Callable[[], LogitEdits]:
    flat_index = staging.add(_flat_index(token_ids, vocab_size, indices))
    value_slot = None if values is None else staging.add(values)
    return lambda: LogitEdits(staging[flat_index], _uploaded(staging, value_slot))


def stage_penalty_rows(
    rows: Mapping[int, RequestSamplingState],
    indices: list[int],
    num_rows: int,
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
    row_slot = _stage_rows(indices, num_rows, staging)
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


def _stage_rows(
    indices: list[int] | npt.NDArray[np.intp], num_rows: int, staging: HostStaging
) -> int | None:
    """Stage a group's batch rows; None (no tensor) when the group is the whole batch."""
    if len(indices) == num_rows:
        return None
    return staging.add(np.asarray(indices, np.int64))


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
