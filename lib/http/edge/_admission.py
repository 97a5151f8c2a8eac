"""Admission by work: `--max-queued-requests` bounds the sequences a request puts into the
engine (prompts x n), not HTTP requests.

Counted this way, one completions request of 20,000 prompts with `n: 4` is 80,000 against
the limit, not 1 (issue 25: it put 80,000 requests into the engine past a limit of 2).
`/tokenize` and `/detokenize` count 1 each: they hold a tokenizer thread, not the engine.

A request is counted from the check itself, with no checkpoint in between (counted any
later, a burst all passes the check); it is held at weight 1 while its body decodes and
then grows to its real weight, checked again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ._errors import RequestError, overloaded


class Held:
    """One request's share of the queue."""

    def __init__(self, admission: Admission, weight: int) -> None:
        self._admission = admission
        self.weight = weight

    def grow(self, weight: int, *, what: str, param: str = "prompt") -> None:
        """Hold `weight` instead (the request's prompts x n, now that they are known).

        Raises:
            RequestError: 400 if `weight` is over the per-request cap or the whole queue
                (`what` says what was counted, e.g. "3 prompts x n 4"); 429 if the queue has
                no room for it now.
        """
        admission = self._admission
        if weight > admission.max_per_request:
            raise RequestError(
                400,
                f"this request asks for {what} = {weight} completions, more than "
                f"--max-prompts-per-request ({admission.max_per_request}); split it into "
                f"smaller requests",
                param=param,
            )
        if weight > admission.max_queued:
            raise RequestError(
                400,
                f"this request asks for {what} = {weight} completions, more than the whole "
                f"queue holds (--max-queued-requests {admission.max_queued}); split it into "
                f"smaller requests",
                param=param,
            )
        extra = weight - self.weight
        if extra > 0:
            admission.take(extra)
        else:
            admission.queued += extra
        self.weight = weight

    def hand_over(self) -> Callable[[], None]:
        """Keep this share past the request's end (a background run): the request then frees
        nothing, and the call returned frees the share, once."""
        weight, self.weight = self.weight, 0

        def release() -> None:
            self._admission.queued -= weight

        return release


class Admission:
    """The queue's limit and what it holds now.

    Attributes:
        queued: the weight admitted and not finished.
    """

    def __init__(self, *, max_queued: int, max_per_request: int) -> None:
        self.max_queued = max_queued
        self.max_per_request = max_per_request
        self.queued = 0

    def has_room(self, weight: int = 1) -> bool:
        return self.queued + weight <= self.max_queued

    def take(self, weight: int) -> None:
        """Count `weight` more, or raise a 429 if it does not fit."""
        if not self.has_room(weight):
            raise overloaded(retry_after=1)
        self.queued += weight

    @contextmanager
    def hold(self, weight: int = 1) -> Iterator[Held]:
        """Count `weight` for the block's duration (429 if it does not fit)."""
        self.take(weight)
        held = Held(self, weight)
        try:
            yield held
        finally:
            self.queued -= held.weight
