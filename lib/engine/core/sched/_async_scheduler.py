"""Async scheduling (`--async-scheduling`): step N+1 is scheduled before N's tokens are known.

vLLM's `AsyncScheduler` (`vllm/v1/core/sched/async_scheduler.py`) in trillm's terms. A step
scheduled *ahead* counts its tokens as computed at once (the synchronous scheduler counts
them when the output comes), and each row that will sample gets an output *placeholder*
(`Request.num_output_placeholders`): `num_tokens` counts it, so the next step computes one
token past it, whose input id the runner takes from the step in flight. When N's output
comes, `update_from_output` replaces each placeholder by its token and checks the stops
then; a request that stopped (EOS, a stop token, max_tokens) or was aborted while N+1 was in
flight is gone from `requests`, and the row N+1 computed for it is dropped, so no token past
a stop reaches the client. The prefix cache indexes only known tokens (`KVCacheManager.
cache_blocks`). A request preempted with a placeholder keeps it until N's output: its token
is appended then, and the request recomputes from its known tokens when readmitted (never
before: a step that preempts admits nobody, and N's output comes before the next schedule).

Steps stay synchronous (no lookahead) while any live request needs its tokens on the host
before its next step: a grammar, penalties or min_tokens (the sampler reads the outputs),
prompt logprobs or prompt embeddings (kept simple), pooling, speculative decoding (drafts
come from the tokens); and when a running request's placeholder will end it by length (its
row at N+1 would pass max_tokens or max_model_len). The engine then takes N's output first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ....gpu import RunnerOutput, StepBatch
from ._request import Request, RequestStatus
from ._scheduler import Scheduler, SchedulerConfig, StepResult


class StepsInFlightError(RuntimeError):
    """A synchronous step was asked for while steps scheduled ahead await their output."""


@dataclass(slots=True)
class _InFlight:
    """A step scheduled ahead: the requests that got a placeholder (by identity: an rnum may
    be reused once its request ended) and those that computed a prompt chunk."""

    sampling: dict[int, Request]
    chunks: list[Request]


class AsyncScheduler(Scheduler):
    """`Scheduler` that schedules ahead when no live request needs its tokens first."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._in_flight: dict[int, _InFlight] = {}  # step -> what it scheduled
        self._needs_sync: dict[int, Request] = {}  # live requests that keep steps synchronous
        # Running requests whose placeholder will end them by length (a row past it would
        # pass max_tokens or max_model_len): found as placeholders are added, so a step costs
        # no loop over the running requests.
        self._ending: list[Request] = []

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if _needs_sync(request):
            self._needs_sync[request.rnum] = request

    def may_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the last one's output is applied."""
        if self.config.speculative is not None:
            return False
        if self._needs_sync:
            live = self.requests
            self._needs_sync = {r: q for r, q in self._needs_sync.items() if live.get(r) is q}
            if self._needs_sync:
                return False
        if self._ending:  # until each one's last placeholder is replaced (it ends then)
            self._ending = [
                r
                for r in self._ending
                if r.num_output_placeholders and r.status is RequestStatus.RUNNING
            ]
        return not self._ending

    def is_ahead(self, batch: StepBatch) -> bool:
        """Whether `batch` was scheduled ahead (its output may be applied a step later)."""
        return batch.step in self._in_flight

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def schedule(self) -> StepBatch:
        """Schedule ahead if `may_schedule_ahead`, else as the synchronous scheduler.

        Raises:
            StepsInFlightError: a synchronous step while steps ahead await their output.
        """
        if not self.may_schedule_ahead():
            if self._in_flight:
                raise StepsInFlightError(
                    f"steps {sorted(self._in_flight)} were scheduled ahead and their outputs "
                    f"are not applied: call update_from_output for them before a synchronous "
                    f"step"
                )
            return super().schedule()
        batch = super().schedule()
        requests, max_model_len = self.requests, self.config.max_model_len
        sampling: dict[int, Request] = {}
        chunks: list[Request] = []
        for rnum, count in zip(
            batch.scheduled_rnums.tolist(), batch.num_scheduled_tokens.tolist(), strict=True
        ):
            request = requests[rnum]
            request.num_computed_tokens += count
            if request.num_computed_tokens < request.num_tokens:
                chunks.append(request)
                continue
            placeholders = request.add_output_placeholder()
            sampling[rnum] = request
            if (
                request.num_output_tokens + placeholders >= request.max_tokens
                or request.num_tokens >= max_model_len
            ):
                self._ending.append(request)
        self._in_flight[batch.step] = _InFlight(sampling, chunks)
        return batch

    def update_from_output(self, batch: StepBatch, output: RunnerOutput) -> StepResult:
        """Apply a step's output; a step ahead replaces its placeholders (see the module)."""
        step = self._in_flight.pop(batch.step, None)
        if step is None:
            return super().update_from_output(batch, output)
        requests, kv = self.requests, self.kv_cache_manager
        max_model_len = self.config.max_model_len
        for request in step.chunks:
            if requests.get(request.rnum) is request:
                kv.cache_blocks(request)
        kept: list[int] = []
        finish: list[int] = []
        num_cached: list[int] = []
        ended: list[Request] = []
        for i, (rnum, token_id) in enumerate(
            zip(output.rnums.tolist(), output.token_ids.tolist(), strict=True)
        ):
            sampled = step.sampling.get(rnum)
            if sampled is None or requests.get(rnum) is not sampled:
                continue  # ended (stopped, aborted) while this step was in flight
            request = sampled
            request.replace_output_placeholder(token_id)
            reason = request.check_stop(token_id, max_model_len)
            running = request.status is RequestStatus.RUNNING
            if running:
                kv.cache_blocks(request)
            if reason:
                request.finish(reason)
                kv.free(request)
                del requests[rnum]
                if running:  # a preempted request's row is dropped already
                    self._finished_rnums.append(rnum)
                ended.append(request)
            kept.append(i)
            finish.append(reason)
            num_cached.append(request.num_cached_tokens)
        if ended:
            self.running = [r for r in self.running if not r.is_finished]
            if any(r in self.waiting for r in ended):
                self.waiting = deque(r for r in self.waiting if not r.is_finished)
        rows = None if len(kept) == len(output.rnums) else kept
        return self._result(batch.step, output, rows, finish, num_cached, {}, [])


def _needs_sync(request: Request) -> bool:
    """Whether `request`'s steps need its sampled tokens on the host before the next one."""
    options = request.options
    return (
        request.status is RequestStatus.WAITING_FOR_GRAMMAR
        or request.grammar is not None
        or options.is_pooling
        or options.needs_penalties
        or options.min_tokens > 0
        or options.prompt_logprobs is not None
        or bool(request.prompt_embeds)
    )
