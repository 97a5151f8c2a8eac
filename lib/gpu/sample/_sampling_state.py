"""What the model runner keeps per request for sampling, across steps.

Each `RequestSamplingState` converts its options to numpy once and mirrors its output tokens
into a growing numpy buffer, so `SamplingBatch.build` does per-step work on whole sequences
(concatenation, counting) in numpy, and O(tokens appended since the last step) in Python.
"""

from __future__ import annotations

import copy

import numpy as np
import numpy.typing as npt
import torch

from ...common.wire import SamplingOptions

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

    def with_outputs(self, extra: list[int]) -> RequestSamplingState:
        """A copy whose outputs go on with `extra` (a speculative position, after the drafts
        before it): same options, prompt and generator; its own output list and mirror."""
        twin = copy.copy(self)
        twin.output_token_ids = [*self.output_token_ids, *extra]
        twin._output_mirror = np.empty(0, dtype=np.int64)
        twin._num_mirrored = 0
        return twin

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
