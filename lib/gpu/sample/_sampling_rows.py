"""The live generation requests' sampling options as columns, by runner row, with counters.

Why: a decode step of plain greedy or plain temperature rows should cost no Python per
request. The model runner writes each request's options into numpy columns once, at its
row (`InputBatch`), and keeps how many live requests use each costly feature; a step's
`SamplingBatch` is then a few gathers by the step's rows (none at all when every live
request is plain greedy), and Python runs only over the rows that need their request's
state (logit_bias, min_tokens, penalties) or have a seed. Outputs are appended only to the
states that read them (penalties, min_tokens).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from ._sampling_batch import SamplingBatch
from ._sampling_columns import (
    COLUMN_DEFAULTS,
    COLUMN_DTYPES,
    SamplingColumns,
    needs_state,
    option_columns,
)
from ._sampling_state import RequestSamplingState


class SamplingRows:
    """Sampling options of the requests at each row; `batch(rows)` builds a step's batch."""

    def __init__(self, max_rows: int) -> None:
        self._columns = [np.zeros(max_rows, dtype) for dtype in COLUMN_DTYPES]
        self._num_set = [0] * len(COLUMN_DTYPES)  # live rows off each column's default
        self._special = np.zeros(max_rows, np.bool_)  # needs its state (`needs_state`)
        self._history = np.zeros(max_rows, np.bool_)  # reads its outputs
        self._seeded = np.zeros(max_rows, np.bool_)
        self._states: list[RequestSamplingState | None] = [None] * max_rows
        self.num_rows = 0
        self.num_special = 0
        self.num_history = 0
        self.num_seeded = 0

    def add(self, row: int, state: RequestSamplingState) -> None:
        """The request of `state` now sits at `row` (free: `remove` its previous one)."""
        if self._states[row] is not None:
            self.remove(row)
        options = state.options
        values = option_columns(options)
        for c, (column, value) in enumerate(zip(self._columns, values, strict=True)):
            column[row] = value
            self._num_set[c] += value != COLUMN_DEFAULTS[c]
        special = needs_state(options)
        history = options.needs_penalties or options.min_tokens > 0
        seeded = state.generator is not None
        self._special[row], self._history[row], self._seeded[row] = special, history, seeded
        self._states[row] = state
        self._count(special, history, seeded, 1)

    def remove(self, row: int) -> None:
        """Forget the request at `row` (an empty row is ignored)."""
        if self._states[row] is None:
            return
        self._states[row] = None
        for c, column in enumerate(self._columns):
            self._num_set[c] -= bool(column[row] != COLUMN_DEFAULTS[c])
        special, history = bool(self._special[row]), bool(self._history[row])
        self._count(special, history, bool(self._seeded[row]), -1)
        self._special[row] = self._history[row] = self._seeded[row] = False

    @property
    def num_random(self) -> int:
        """Live requests sampled at random (temperature > 0)."""
        return self._num_set[0]

    @property
    def num_logprobs(self) -> int:
        """Live requests that asked for logprobs."""
        return self._num_set[-1]

    def _count(self, special: bool, history: bool, seeded: bool, by: int) -> None:
        self.num_rows += by
        self.num_special += by * special
        self.num_history += by * history
        self.num_seeded += by * seeded

    def batch(
        self,
        rows: npt.NDArray[np.int64],
        *,
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        """The `SamplingBatch` of the requests at `rows`, in that order (`SamplingBatch.build`'s
        result for their states): nothing per row when every live request is plain greedy."""
        if not (self.num_random or self.num_logprobs or self.num_special):
            return SamplingBatch.greedy(len(rows), vocab_size)
        gathered: list[np.ndarray | None] = [
            column[rows] if num_set else None
            for column, num_set in zip(self._columns, self._num_set, strict=True)
        ]
        random, temperature, top_k, top_p, min_p, logprobs = gathered
        columns = SamplingColumns(
            len(rows),
            random,
            temperature,
            top_k,
            top_p,
            min_p,
            logprobs,
            self._states_of(rows, self._special, self.num_special),
            [
                (i, generator)
                for i, state in self._states_of(rows, self._seeded, self.num_seeded)
                if (generator := state.generator) is not None
            ],
        )
        return SamplingBatch.from_columns(
            columns, eos_token_id=eos_token_id, vocab_size=vocab_size, device=device
        )

    def append_outputs(self, rows: npt.NDArray[np.int64], token_ids: npt.NDArray[np.int32]) -> None:
        """Append each row's sampled token to its state, where the state reads its outputs."""
        if not self.num_history:
            return
        for i, state in self._states_of(rows, self._history, self.num_history):
            state.output_token_ids.append(int(token_ids[i]))

    def append_runs(
        self,
        rows: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        token_ids: npt.NDArray[np.int32],
    ) -> None:
        """Append each row's run of accepted tokens (`token_ids[offsets[i]:offsets[i + 1]]`,
        a verify step's) to its state, where the state reads its outputs."""
        if not self.num_history:
            return
        for i, state in self._states_of(rows, self._history, self.num_history):
            state.output_token_ids.extend(token_ids[offsets[i] : offsets[i + 1]].tolist())

    def _states_of(
        self, rows: npt.NDArray[np.int64], flag: npt.NDArray[np.bool_], count: int
    ) -> list[tuple[int, RequestSamplingState]]:
        """(position in `rows`, state) of the rows whose `flag` is set (`count` live ones)."""
        if not count:
            return []
        found = []
        for i in np.flatnonzero(flag[rows]).tolist():
            state = self._states[int(rows[i])]
            assert state is not None  # `rows` are live rows
            found.append((i, state))
        return found
