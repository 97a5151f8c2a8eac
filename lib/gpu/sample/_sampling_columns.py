"""A step's rows' sampling options as numpy columns, and each row's values of them.

Why: the runner keeps these columns per row (`SamplingRows`), so a step gathers them with
numpy instead of a Python loop over its rows; `SamplingBatch.from_columns` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...common.wire import SamplingOptions
from ._sampling_state import RequestSamplingState


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
