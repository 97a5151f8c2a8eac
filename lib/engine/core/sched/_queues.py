"""The scheduler's queues and its requests in and out: what it holds between steps.

`Scheduler`'s state, apart from its two halves (deciding a step: `_scheduler`; applying the
step's output: `_postprocess`) so that each reads alone: the waiting and running queues, every
unfinished request by rnum, the admission checks (`add_request`), grammars compiled or failed,
aborts, and what callers read of it (counters, `statistics`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ....gpu import StepBatch
from ...protocol._step_record import FinishReason
from .._grammar import GrammarState
from ..kv._kv_cache_manager import KVCacheManager
from ._request import Request, RequestStatus
from ._scheduler_types import InvalidRequestError, SchedulerConfig, SchedulerStats
from ._spec_decode import SpecDecodingStats


class SchedulerQueues:
    """The queues, the KV-cache manager and the requests of one scheduler: requests in and
    out, and what callers read; `Scheduler` adds deciding a step and applying its output."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests re-enter at the front
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.requests: dict[int, Request] = {}  # rnum -> every unfinished request
        # Requests whose grammar compiles (structured outputs): in `requests`, in no queue.
        self.waiting_for_grammar: dict[int, Request] = {}
        # The unfinished pooling requests: a step without them skips `_finish_pooled`'s look.
        self._pooling: set[int] = set()
        self.num_preemptions = 0
        # Prompt tokens the running decodes earned and prompts have not spent (the prefill cap).
        self.prefill_credit = 0
        self._step = 0
        self._finished_rnums: list[int] = []  # rows the runner drops at its next step
        self._aborted: list[Request] = []  # aborts the next result reports
        self.spec_stats = SpecDecodingStats()

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue `request` behind every waiting one.

        Raises:
            InvalidRequestError: its rnum is in use, its prompt is empty or leaves no room for
                an output within `max_model_len`, `max_tokens` < 1, or its prompt embeddings
                are not float32 [prompt tokens, hidden size].
        """
        max_model_len = self.config.max_model_len
        if request.rnum in self.requests:
            raise InvalidRequestError(f"request number {request.rnum} is already in use")
        if not request.prompt_token_ids:
            raise InvalidRequestError(
                f"request {request.rnum} has an empty prompt: send at least one token"
            )
        # A pooling request generates nothing, so its prompt may fill max_model_len.
        room = 0 if request.options.is_pooling else 1
        if request.num_tokens > max_model_len - room:
            raise InvalidRequestError(
                f"request {request.rnum} has {request.num_tokens} prompt tokens, leaving no "
                f"room to generate within max_model_len {max_model_len}: send at most "
                f"{max_model_len - room}"
            )
        if request.max_tokens < 1:
            raise InvalidRequestError(
                f"request {request.rnum} asks for max_tokens {request.max_tokens}: ask for >= 1"
            )
        expected = 4 * request.num_prompt_tokens * self.config.hidden_size
        if request.prompt_embeds and len(request.prompt_embeds) != expected:
            raise InvalidRequestError(
                f"request {request.rnum} sends {len(request.prompt_embeds)} bytes of prompt "
                f"embeddings for {request.num_prompt_tokens} positions: send float32 "
                f"[{request.num_prompt_tokens}, {self.config.hidden_size}], {expected} bytes"
            )
        self.requests[request.rnum] = request
        if request.options.is_pooling:
            self._pooling.add(request.rnum)
        if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar[request.rnum] = request
        else:
            self.waiting.append(request)

    def grammar_ready(self, rnum: int, grammar: GrammarState) -> bool:
        """Queue a request whose grammar compiled (False: it was aborted meanwhile)."""
        request = self.waiting_for_grammar.pop(rnum, None)
        if request is None:
            return False
        for token in request.output_token_ids:  # a resumed request: replay what it made
            grammar.accept(token)
        request.grammar = grammar
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        return True

    def grammar_failed(self, rnum: int) -> bool:
        """Finish with ERROR a request whose grammar failed to compile (False: it was
        aborted meanwhile). It holds no blocks; the caller reports its error row."""
        request = self.waiting_for_grammar.pop(rnum, None)
        if request is None:
            return False
        del self.requests[rnum]
        request.finish(FinishReason.ERROR)
        return True

    def abort_requests(
        self, rnums: Iterable[int], *, reason: FinishReason = FinishReason.ABORT
    ) -> list[Request]:
        """Finish `rnums` with `reason` (ABORT; ERROR: a request that failed alone) and free
        their blocks now; unknown or finished rnums are ignored. The next
        `update_from_output` reports each one in a row of its own.

        Returns:
            The requests aborted by this call.
        """
        aborted = []
        for rnum in rnums:
            request = self.requests.pop(int(rnum), None)
            if request is None:
                continue
            self._pooling.discard(request.rnum)
            if request.status is RequestStatus.RUNNING:
                self._finished_rnums.append(request.rnum)
            self.waiting_for_grammar.pop(request.rnum, None)
            self.kv_cache_manager.free(request)
            request.finish(reason)
            aborted.append(request)
        if aborted:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
            self._aborted.extend(aborted)
        return aborted

    def unfinished_rnums(self) -> list[int]:
        return list(self.requests)

    # -- introspection -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def grammar_states(self, batch: StepBatch) -> list[GrammarState]:
        """The grammar state of each of `batch.grammar_rnums`, in order (the mask rows)."""
        states = [self.requests[rnum].grammar for rnum in batch.grammar_rnums.tolist()]
        return [s for s in states if s is not None]  # schedule() lists only rows with one

    def has_schedulable_requests(self) -> bool:
        """Whether a step has work: requests queued or running (not only compiling)."""
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; refused (False) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def statistics(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            step=self._step,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_free_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_position=tuple(self.spec_stats.accepted_per_position),
        )
