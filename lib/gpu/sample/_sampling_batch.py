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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ...common.wire import SamplingOptions
from ..runner._pinned import HostStaging
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
            _stage_random_rows(columns, random_rows, vocab_size, staging)
            if random_rows is not None and len(random_rows)
            else None
        )
        bias = _stage_logit_bias(states, bias_rows, vocab_size, staging) if bias_rows else None
        masked = (
            _stage_token_edits(masked_rows, masked_ids, None, vocab_size, staging)
            if masked_rows
            else None
        )
        penalties = (
            _stage_penalty_rows(states, penalty_rows, num_rows, vocab_size, staging, device)
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


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """A step's rows' options as numpy columns ([B] each, in the logits' row order), and
    the few rows whose request state the batch needs: what `SamplingBatch.from_columns`
    reads. A column is None where every row has its default (`COLUMN_DEFAULTS`), so the
    common steps gather and check only the columns some live request sets; each row's
    values are `option_columns`'."""

    num_rows: int
    random: np.ndarray | None  # bool: temperature > 0
    temperature: np.ndarray | None  # float64
    top_k: np.ndarray | None  # int64, 0: off
    top_p: np.ndarray | None  # float64
    min_p: np.ndarray | None  # float64
    logprobs: np.ndarray | None  # int64, -1: none asked
    special: Sequence[tuple[int, RequestSamplingState]]  # logit_bias, min_tokens, penalties
    seeded: Sequence[tuple[int, torch.Generator]]  # rows with a generator (random or not)

    @classmethod
    def of(cls, rows: Sequence[RequestSamplingState]) -> SamplingColumns:
        """The columns of `rows` (a Python loop over them)."""
        values = [option_columns(r.options) for r in rows]
        by_column = list(zip(*values, strict=True)) if values else [()] * len(COLUMN_DTYPES)
        columns: list[np.ndarray | None] = [
            np.array(column, dtype) if any(v != default for v in column) else None
            for column, dtype, default in zip(
                by_column, COLUMN_DTYPES, COLUMN_DEFAULTS, strict=True
            )
        ]
        random, temperature, top_k, top_p, min_p, logprobs = columns
        return cls(
            len(rows),
            random,
            temperature,
            top_k,
            top_p,
            min_p,
            logprobs,
            [(i, r) for i, r in enumerate(rows) if needs_state(r.options)],
            [(i, r.generator) for i, r in enumerate(rows) if r.generator is not None],
        )


COLUMN_DTYPES = (np.bool_, np.float64, np.int64, np.float64, np.float64, np.int64)
COLUMN_DEFAULTS = (False, 1.0, 0, 1.0, 0.0, -1)


def option_columns(options: SamplingOptions) -> tuple[bool, float, int, float, float, int]:
    """One row's values of `SamplingColumns`' columns, in `COLUMN_DTYPES`' order."""
    k = -1 if options.logprobs is None else options.logprobs
    return (
        not options.is_greedy,
        options.temperature,
        max(options.top_k, 0),
        options.top_p,
        options.min_p,
        k,
    )


def needs_state(options: SamplingOptions) -> bool:
    """Whether a row's batch entries need its request's state (token ids, outputs)."""
    return bool(options.logit_bias or options.min_tokens or options.needs_penalties)


# Each _stage_* puts its group's host arrays in the staging buffer and returns the function
# that, once the buffer is uploaded, makes the group's record from the device tensors.


def _stage_random_rows(
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


def _stage_logit_bias(
    rows: Mapping[int, RequestSamplingState],
    indices: list[int],
    vocab_size: int,
    staging: HostStaging,
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
