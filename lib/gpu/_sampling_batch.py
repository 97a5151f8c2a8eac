"""Per-request sampling state, and the per-step vectorised batch built from it.

A step's rows rarely use more than a few of the sampling options, so the batch holds tensors
only for the options some row uses: a batch of plain greedy rows is an empty record and the
sampler does one argmax. `SamplingBatch.build` costs O(batch) Python per step plus, for
penalised rows, O(tokens appended since the last step): each `RequestSamplingState` converts
its options to numpy once and mirrors its output tokens into a growing numpy buffer, so the
per-step work on whole sequences (concatenation, counting) is done by numpy and torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ._sampling_options import SamplingOptions

_SEED_MASK = (1 << 64) - 1  # torch generators take seeds in [0, 2**64)


class TokenIdOutOfVocabError(ValueError):
    """A request names a token id outside the model's vocabulary (in logit_bias,
    stop_token_ids or its prompt); the engine should validate ids against the vocabulary."""


class RequestSamplingState:
    """What the model runner keeps per request for sampling.

    `output_token_ids` is the list the runner appends each step's sampled token to; the
    sampler reads it at `SamplingBatch.build` (for penalties and min_tokens). Append to it
    freely but shorten it only with `truncate_output`: penalised requests mirror it into numpy
    incrementally, by length. `generator` exists when the request is seeded, so its noise is
    its own.

    Args:
        options: the request's validated sampling options.
        prompt_token_ids: the prompt (for the repetition penalty), stored as int32 numpy.
        device: where the seeded generator lives (the logits' device).
    """

    __slots__ = (
        "_bias_token_ids",
        "_bias_values",
        "_checked_vocab_size",
        "_num_mirrored",
        "_output_mirror",
        "_stop_token_ids",
        "generator",
        "options",
        "output_token_ids",
        "prompt_token_ids",
    )

    def __init__(
        self,
        options: SamplingOptions,
        prompt_token_ids: npt.ArrayLike,
        device: torch.device,
    ) -> None:
        self.options = options
        self.prompt_token_ids: npt.NDArray[np.int32] = np.ascontiguousarray(
            prompt_token_ids, dtype=np.int32
        ).reshape(-1)
        self.output_token_ids: list[int] = []
        self.generator: torch.Generator | None = None
        if options.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(options.seed & _SEED_MASK)
        self._bias_token_ids = np.array([t for t, _ in options.logit_bias], dtype=np.int64)
        self._bias_values = np.array([b for _, b in options.logit_bias], dtype=np.float32)
        self._stop_token_ids = np.array(options.stop_token_ids, dtype=np.int64)
        self._output_mirror = np.empty(0, dtype=np.int64)
        self._num_mirrored = 0
        self._checked_vocab_size = 0

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise TokenIdOutOfVocabError if an id the sampler indexes by lies outside [0, V).

        Out-of-range indices would fault the device mid-step; checked once per vocab size.
        """
        if self._checked_vocab_size == vocab_size:
            return
        for what, ids in (
            ("logit_bias", self._bias_token_ids),
            ("stop_token_ids", self._stop_token_ids),
            ("prompt", self.prompt_token_ids),
        ):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
                raise TokenIdOutOfVocabError(
                    f"{what} token id {bad} is outside the vocabulary [0, {vocab_size}); "
                    "reject the request before it reaches the model runner"
                )
        self._checked_vocab_size = vocab_size

    def truncate_output(self, num_tokens: int) -> None:
        """Keep the first num_tokens output tokens (e.g. after rejected draft tokens)."""
        del self.output_token_ids[num_tokens:]
        self._num_mirrored = min(self._num_mirrored, num_tokens)

    def output_token_array(self) -> npt.NDArray[np.int64]:
        """The output tokens as numpy, converting only those appended since the last call."""
        num_output = len(self.output_token_ids)
        if num_output < self._num_mirrored:  # shortened without truncate_output
            self._num_mirrored = num_output
        if num_output > len(self._output_mirror):
            grown = np.empty(max(64, 2 * num_output), dtype=np.int64)
            grown[: self._num_mirrored] = self._output_mirror[: self._num_mirrored]
            self._output_mirror = grown
        if num_output > self._num_mirrored:
            new = self.output_token_ids[self._num_mirrored :]
            self._output_mirror[self._num_mirrored : num_output] = new
            self._num_mirrored = num_output
        return self._output_mirror[:num_output]

    def min_tokens_masked_ids(self, eos_token_id: int | None) -> npt.NDArray[np.int64] | None:
        """Token ids to mask this step (stop ids and EOS), or None once min_tokens is reached.

        EOS is masked even with ignore_eos: that flag only changes when the engine stops.
        """
        if len(self.output_token_ids) >= self.options.min_tokens:
            return None
        if eos_token_id is None:
            return self._stop_token_ids
        return np.append(self._stop_token_ids, np.int64(eos_token_id))


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
    log_min_p: torch.Tensor | None  # [R] float32; -inf for rows with min_p off
    seeded: tuple[tuple[int, torch.Generator], ...]  # (position among random rows, generator)
    all_seeded: bool


@dataclass(frozen=True, slots=True)
class LogitEdits:
    """Sparse per-token edits: add `values` (or -inf) at (rows, token_ids)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
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
        """Gather this step's rows into tensors on `device`.

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
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            random=_random_rows(rows, random_rows, vocab_size, device) if random_rows else None,
            logit_bias=_logit_bias(rows, bias_rows, device) if bias_rows else None,
            min_tokens_mask=(
                _token_edits(masked_rows, masked_ids, None, device) if masked_rows else None
            ),
            penalties=(
                _penalty_rows(rows, penalty_rows, vocab_size, device) if penalty_rows else None
            ),
            max_logprobs=max_logprobs,
        )


def _random_rows(
    rows: Sequence[RequestSamplingState], indices: list[int], vocab_size: int, device: torch.device
) -> RandomRows:
    options = [rows[i].options for i in indices]
    temperatures = [o.temperature for o in options]
    top_ks = [min(o.top_k, vocab_size) if o.top_k > 0 else 0 for o in options]
    max_top_k = max(top_ks)
    generators = [rows[i].generator for i in indices]
    seeded = tuple((j, g) for j, g in enumerate(generators) if g is not None)
    return RandomRows(
        rows=None if len(indices) == len(rows) else _tensor(indices, torch.int64, device),
        temperature=(
            None
            if all(t == 1.0 for t in temperatures)
            else _tensor(temperatures, torch.float32, device)
        ),
        top_k=(
            None
            if max_top_k == 0
            else _tensor([k or vocab_size for k in top_ks], torch.int64, device)
        ),
        max_top_k=max_top_k,
        top_p=(
            None
            if all(o.top_p >= 1.0 for o in options)
            else _tensor([min(o.top_p, 1.0) for o in options], torch.float32, device)
        ),
        log_min_p=(
            None
            if all(o.min_p <= 0.0 for o in options)
            else _tensor(
                [math.log(o.min_p) if o.min_p > 0.0 else -math.inf for o in options],
                torch.float32,
                device,
            )
        ),
        seeded=seeded,
        all_seeded=len(seeded) == len(indices),
    )


def _logit_bias(
    rows: Sequence[RequestSamplingState], indices: list[int], device: torch.device
) -> LogitEdits:
    states = [rows[i] for i in indices]
    values = np.concatenate([s._bias_values for s in states])
    return _token_edits(indices, [s._bias_token_ids for s in states], values, device)


def _token_edits(
    indices: list[int],
    token_ids: list[npt.NDArray[np.int64]],
    values: npt.NDArray[np.float32] | None,
    device: torch.device,
) -> LogitEdits:
    lengths = [len(ids) for ids in token_ids]
    return LogitEdits(
        rows=_from_numpy(np.repeat(np.asarray(indices, dtype=np.int64), lengths), device),
        token_ids=_from_numpy(np.concatenate(token_ids), device),
        values=None if values is None else _from_numpy(values, device),
    )


def _penalty_rows(
    rows: Sequence[RequestSamplingState], indices: list[int], vocab_size: int, device: torch.device
) -> PenaltyRows:
    states = [rows[i] for i in indices]
    options = [s.options for s in states]
    shape = (len(states), vocab_size)
    output_counts = torch.zeros(shape, dtype=torch.float32, device=device)
    output_index = _flat_index([s.output_token_array() for s in states], vocab_size)
    if output_index.size:
        one = torch.ones((), dtype=torch.float32, device=device)
        output_counts.view(-1).index_put_((_from_numpy(output_index, device),), one, True)
    repetition = [o.repetition_penalty for o in options]
    prompt_mask = None
    if any(r != 1.0 for r in repetition):
        prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
        prompt_index = _flat_index([s.prompt_token_ids for s in states], vocab_size)
        prompt_mask.view(-1)[_from_numpy(prompt_index, device)] = True
    return PenaltyRows(
        rows=None if len(indices) == len(rows) else _tensor(indices, torch.int64, device),
        output_counts=output_counts,
        prompt_mask=prompt_mask,
        repetition=_tensor(repetition, torch.float32, device),
        frequency=_tensor([o.frequency_penalty for o in options], torch.float32, device),
        presence=_tensor([o.presence_penalty for o in options], torch.float32, device),
    )


def _flat_index(
    token_ids: list[npt.NDArray[np.int32]] | list[npt.NDArray[np.int64]], vocab_size: int
) -> npt.NDArray[np.int64]:
    """Indices into a [len(token_ids), vocab_size] tensor viewed flat: row * V + token."""
    lengths = [len(ids) for ids in token_ids]
    row_offsets = np.repeat(np.arange(len(token_ids), dtype=np.int64) * vocab_size, lengths)
    return row_offsets + np.concatenate(token_ids).astype(np.int64, copy=False)


def _tensor(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _from_numpy(array: npt.NDArray[np.generic], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)
