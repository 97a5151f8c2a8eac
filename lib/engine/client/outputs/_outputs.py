"""What a generation stream yields, and the one-slot mailbox between the pump and a consumer.

The output pump `put`s into a request's mailbox once per step; if the consumer has not taken
the previous output yet, the new one merges into it (text and tokens concatenated), so a slow
consumer gets bigger chunks, never fewer tokens. Waking is a bare `trio.lowlevel.reschedule`
of the one waiting task, done by the pump for all mailboxes of a step together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import trio

from ...protocol._step_record import FinishReason

# finish code -> the name clients see (`finish_reason`)
FINISH_REASONS = {int(r): r.name.lower() for r in FinishReason if r is not FinishReason.NONE}


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's logprob and the top alternatives (OpenAI's `logprobs` content)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class Output:
    """New content of one completion (child `index` when n > 1) since its last output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative, for usage
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's result (the STEP record's pooled rows), in its finishing output.
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: Output) -> None:
        """Fold `later` (the same child's next output) into this unread one."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + later.prompt_logprobs
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens or self.num_cached_tokens
        if later.pooled is not None:
            self.pooled = later.pooled


@dataclass(slots=True)
class Mailbox:
    """One request's unread outputs (one slot per child) and the task waiting for them."""

    pending: dict[int, Output] = field(default_factory=dict)
    error: BaseException | None = None
    waiter: trio.lowlevel.Task | None = None

    def put(self, output: Output) -> bool:
        """Store or merge `output`; True if a consumer waits and must be woken."""
        unread = self.pending.get(output.index)
        if unread is None:
            self.pending[output.index] = output
        else:
            unread.merge(output)
        return self.waiter is not None

    def fail(self, error: BaseException) -> bool:
        """Make the consumer raise `error` once it has read what is pending."""
        self.error = error
        return self.waiter is not None

    def wake(self) -> None:
        task, self.waiter = self.waiter, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def get(self) -> list[Output]:
        """The unread outputs (by child index); waits for the next step if there are none."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self.pending and self.error is None:
            if self.waiter is not None:
                raise trio.BusyResourceError("another task is already reading this stream")
            self.waiter = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self.waiter = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if self.pending:
            outputs = [self.pending[i] for i in sorted(self.pending)]
            self.pending.clear()
            return outputs
        assert self.error is not None
        raise self.error
