"""The engine's copy of a request (DESIGN.md §2): its tokens, progress and why it ended.

The frontend owns the client-facing state; this copy holds what scheduling needs: the token
ids (prompt and outputs, kept in one list so block hashing and preemption never concatenate),
how many of them have KV in the cache, and the chained hashes of its full blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from ....gpu import PromptLogprobs, SamplingOptions
from ...protocol._step_record import FinishReason
from .._grammar import GrammarState


class RequestStatus(enum.Enum):
    """WAITING: queued, never run. RUNNING: admitted, holds blocks. PREEMPTED: queued again,
    its blocks freed, its outputs kept. FINISHED: done, for the `finish_reason`.
    WAITING_FOR_GRAMMAR: its grammar compiles; held outside the queues until it is ready."""

    WAITING_FOR_GRAMMAR = enum.auto()
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Request:
    """One generation: prompt, outputs so far, and the scheduler's bookkeeping.

    Identity is the object (and its `rnum`), never field equality: the scheduler's queues
    compare by identity.
    """

    rnum: int
    prompt_token_ids: list[int]
    options: SamplingOptions
    max_tokens: int
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    # vLLM's cache_salt: mixed into the first block's hash, so requests with another salt
    # (or none) never share this one's cached blocks ("": none).
    cache_salt: str = ""
    # The prompt as float32 embeddings [prompt tokens, hidden] (b"": none); its token ids are
    # placeholders, so it neither reads nor fills the prefix cache.
    prompt_embeds: bytes = b""
    # The LoRA adapter (0: the base model) and its digest (sha256 of its files), which names
    # its KV in the prefix cache: no other adapter's request, nor the base's, shares a block.
    lora_id: int = 0
    lora_digest: bytes = b""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = 0  # prefix-cache hits when first scheduled
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason = FinishReason.NONE
    # Chained hashes of full blocks (sha256 digests), extended lazily by the KV-cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # One past the last prompt position whose logprobs were reported (positions start at 1),
    # so a recompute after preemption does not report them twice.
    prompt_logprobs_end: int = 1
    grammar: GrammarState | None = None  # structured outputs: the matcher, once compiled
    # Speculative decoding: the draft tokens the runner proposed after the last step, which
    # the next one verifies (`_spec_decode`); never outputs until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling (`_async_scheduler`): tokens a step in flight will sample for it, not
    # known yet; counted in `num_tokens`, so the next step computes past them.
    num_output_placeholders: int = 0
    _all_token_ids: list[int] = field(init=False, repr=False)
    _num_tokens: int = field(init=False, repr=False)  # known tokens and placeholders
    # EOS (unless ignored) and the stop token ids: one set test per sampled token.
    stop_token_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        self._num_tokens = len(self._all_token_ids) + self.num_output_placeholders
        stop = set(self.options.stop_token_ids)
        if self.eos_token_id is not None and not self.options.ignore_eos:
            stop.add(self.eos_token_id)
        self.stop_token_set = frozenset(stop)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far, the placeholders of steps in flight counted."""
        return self._num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then outputs, without a copy: read it, never mutate it."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token (the decode path's only per-token work)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self._num_tokens += 1

    def add_output_placeholder(self) -> int:
        """Count a token that a step in flight will sample; returns the placeholders."""
        self.num_output_placeholders += 1
        self._num_tokens += 1
        return self.num_output_placeholders

    def replace_output_placeholder(self, token_id: int) -> None:
        """Record the token of the oldest placeholder (`add_output_placeholder`)."""
        self.num_output_placeholders -= 1
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> FinishReason:
        """Whether the request ends with its newest token, `token_id`.

        A stop token (EOS unless ignored, or one of `stop_token_ids`) counts only once
        `min_tokens` were generated, as the sampler masks it before; it wins over a length cap
        reached by the same token, since the model did end there.
        """
        num_output = len(self.output_token_ids)
        if token_id in self.stop_token_set and num_output >= self.options.min_tokens:
            return FinishReason.STOP
        if num_output >= self.max_tokens or len(self._all_token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def take_new_prompt_logprobs(self, chunk: PromptLogprobs) -> PromptLogprobs | None:
        """The part of `chunk` not reported before (a recompute after a preemption repeats
        positions), counted as reported now; None if nothing is new."""
        skip = self.prompt_logprobs_end - chunk.first_position
        if skip >= len(chunk.logprobs):
            return None
        if skip > 0:
            chunk = PromptLogprobs(
                self.prompt_logprobs_end,
                chunk.logprobs[skip:],
                None if chunk.topk_ids is None else chunk.topk_ids[skip:],
                None if chunk.topk_logprobs is None else chunk.topk_logprobs[skip:],
            )
        self.prompt_logprobs_end = chunk.first_position + len(chunk.logprobs)
        return chunk

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
