"""The runner's persistent per-request state: token ids and block tables in fixed rows.

A request keeps one row from its first step to its last; each step only appends (new block
ids, the sampled token) instead of rebuilding per-request inputs. The flattened inputs of a
step (token ids, positions, slots) are then a handful of vectorised numpy gathers over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._step_batch import NewRequest


class CapacityError(RuntimeError):
    """The scheduler sent more than the runner was sized for."""


@dataclass(frozen=True)
class StepInputs:
    """A step's flattened inputs (numpy), ready to become tensors."""

    rows: np.ndarray  # [B] row of each scheduled request, in scheduled order
    counts: np.ndarray  # [B] tokens scheduled for it
    token_starts: np.ndarray  # [B] index of its first token in the flattened batch
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    context_lens: np.ndarray  # [B] computed + scheduled tokens
    samples: np.ndarray  # [B] bool: this step reaches the sequence's end, so it samples


class InputBatch:
    """Rows of token ids, block tables and counters, indexed by request number."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)  # prompt + output so far
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_computed = np.zeros(max_num_reqs, np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        self.row_of: dict[int, int] = {}
        # Bumped when a row changes hands: a late result (async scheduling) finds its row by
        # (row, generation), never by a row given to another request since.
        self.generation = np.zeros(max_num_reqs, np.int64)
        self._index: tuple[np.ndarray, np.ndarray] | None = None  # row_of sorted (`rows_of`)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, request: NewRequest) -> int:
        """Give `request` a row (replacing an earlier one of the same rnum). Returns the row."""
        self.remove(request.rnum)
        if not self._free_rows:
            raise CapacityError(f"more than {len(self.num_tokens)} requests at once")
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        if len(tokens) > self.max_model_len:
            raise CapacityError(f"{len(tokens)} tokens exceed max_model_len {self.max_model_len}")
        row = self._free_rows.pop()
        self.row_of[request.rnum] = row
        self.generation[row] += 1
        self._index = None
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(request.prompt_token_ids)
        self.num_computed[row] = request.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, request.block_ids)
        return row

    def remove(self, rnum: int) -> None:
        """Free `rnum`'s row (unknown numbers are ignored)."""
        row = self.row_of.pop(rnum, None)
        if row is not None:
            self._free_rows.append(row)
            self.generation[row] += 1
            self._index = None

    def rows_of(self, rnums: np.ndarray) -> np.ndarray:
        """The rows of `rnums` (int64), vectorised: a binary search in `row_of` sorted,
        which is rebuilt only after adds and removes (a decode step has neither).

        Raises:
            KeyError: an rnum has no row (the scheduler sent a request the runner never got).
        """
        if self._index is None:
            keys = np.fromiter(self.row_of, np.uint64, len(self.row_of))
            rows = np.fromiter(self.row_of.values(), np.int64, len(self.row_of))
            order = np.argsort(keys)
            self._index = keys[order], rows[order]
        keys, rows = self._index
        rnums = rnums.astype(np.uint64, copy=False)  # int64 against uint64 would be float64
        at = np.searchsorted(keys, rnums)
        if len(rnums) and (int(at.max()) >= len(keys) or not np.array_equal(keys[at], rnums)):
            missing = [r for r in rnums.tolist() if r not in self.row_of]
            raise KeyError(f"requests {missing} have no row: add them before scheduling them")
        found: np.ndarray = rows[at]
        return found

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        n = int(self.num_blocks[row])
        if n + len(block_ids) > self.block_table.shape[1]:
            raise CapacityError("a request got more blocks than max_model_len needs")
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of `rows`."""
        ends = self.num_tokens[rows]
        if len(ends) and int(ends.max()) >= self.max_model_len:
            raise CapacityError(f"a request grew past max_model_len {self.max_model_len}")
        self.token_ids[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1

    def append_placeholders(self, rows: np.ndarray) -> np.ndarray:
        """Count one token more in each of `rows`, not known yet (a step's output read later,
        `_ahead`); `token_ids` holds 0 there until `append_tokens_at`. Returns the positions."""
        ends: np.ndarray = self.num_tokens[rows].astype(np.int64)
        if len(ends) and int(ends.max()) >= self.max_model_len:
            raise CapacityError(f"a request grew past max_model_len {self.max_model_len}")
        self.token_ids[rows, ends] = 0
        self.num_tokens[rows] = ends + 1
        return ends

    def append_tokens_at(
        self, rows: np.ndarray, generations: np.ndarray, positions: np.ndarray, tokens: np.ndarray
    ) -> np.ndarray:
        """Write the tokens of placeholders (`append_placeholders`) into the rows still held
        by the same requests. Returns the mask of those rows."""
        live: np.ndarray = self.generation[rows] == generations
        self.token_ids[rows[live], positions[live]] = tokens[live]
        return live

    def append_token_runs(self, rows: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> None:
        """Append `tokens[offsets[i]:offsets[i + 1]]` to row `rows[i]` (a verify step's
        accepted drafts and the token after them)."""
        for i, row in enumerate(rows.tolist()):
            start, end = int(offsets[i]), int(offsets[i + 1])
            n = int(self.num_tokens[row])
            if n + end - start > self.max_model_len:
                raise CapacityError(f"a request grew past max_model_len {self.max_model_len}")
            self.token_ids[row, n : n + end - start] = tokens[start:end]
            self.num_tokens[row] = n + end - start

    def prepare(self, rnums: np.ndarray, counts: np.ndarray) -> StepInputs:
        """Flatten the scheduled requests' tokens; advances nothing (see `advance`)."""
        rows = self.rows_of(rnums)
        counts = counts.astype(np.int64)
        if len(counts) and int(counts.max()) == 1:
            return self._prepare_decodes(rows, counts)
        starts = np.cumsum(counts) - counts
        token_row = np.repeat(np.arange(len(rows)), counts)
        computed = self.num_computed[rows].astype(np.int64)
        positions = computed[token_row] + np.arange(int(counts.sum())) - starts[token_row]
        req_rows = rows[token_row]
        blocks = self.block_table[req_rows, positions // self.block_size].astype(np.int64)
        context = computed + counts
        return StepInputs(
            rows=rows,
            counts=counts,
            token_starts=starts,
            input_ids=self.token_ids[req_rows, positions].astype(np.int64),
            positions=positions,
            slots=blocks * self.block_size + positions % self.block_size,
            context_lens=context,
            samples=context >= self.num_tokens[rows],
        )

    def _prepare_decodes(self, rows: np.ndarray, counts: np.ndarray) -> StepInputs:
        """`prepare` of a step where each request has one token (most steps): the same
        arrays with half the numpy calls (each costs about a microsecond at any batch)."""
        positions = self.num_computed[rows].astype(np.int64)
        blocks = self.block_table[rows, positions // self.block_size].astype(np.int64)
        context = positions + 1
        return StepInputs(
            rows=rows,
            counts=counts,
            token_starts=np.arange(len(rows), dtype=np.int64),
            input_ids=self.token_ids[rows, positions].astype(np.int64),
            positions=positions,
            slots=blocks * self.block_size + positions % self.block_size,
            context_lens=context,
            samples=context >= self.num_tokens[rows],
        )

    def advance(self, inputs: StepInputs) -> None:
        """Count this step's tokens as computed."""
        self.num_computed[inputs.rows] = inputs.context_lens
