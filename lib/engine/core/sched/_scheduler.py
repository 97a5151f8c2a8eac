"""Continuous batching: which requests compute how many tokens each step (DESIGN.md §6).

Every step fills a token budget, first-come first-served: running requests first (one token
per decode, the next chunk of an unfinished prompt), then waiting ones, each admitted with
its prefix-cache hits counted as computed. A prompt larger than what is left of the budget
gets a partial chunk (chunked prefill), so long prompts never stall the decodes.

While decodes run, pooling prompts (embeddings) get a share of the steps: each step with
decodes earns `max_prefill_tokens_per_decode` prompt tokens per running decode (credit kept
up to one step's budget), every prompt token computed while decodes run spends it (generation
prompts too), and a pooling prompt runs once the credit covers it whole (or is full, for one
longer than the budget). So a flood of embeddings computes on average at most that many
tokens per decode per step, which bounds how much it stretches the streams' time per output
token; and in whole prompts, not slivers, because a step with any prompt costs much more
than a decode step (it leaves the decode fast path: the C step, CUDA graphs). Generation
prompts are not held back, and pass pooling ones that wait for credit: they become streams
(throttling them shrinks the batch; a c=32 load starved itself so, perf/README.md), where an
embedding only takes from the streams. Credit saved while decoding serves a burst at once.
vLLM fills the budget's rest with any prompt (its `long_prefill_token_threshold` caps one
prompt's chunk, not the step's prompts); `max_prefill_tokens_per_decode` 0 does that here.

When a running request needs a block and none is free, the newest running request is
preempted by recompute: its blocks are freed and it goes back to the front of `waiting`
with its outputs kept; readmitted, it is a new request to the runner again and recomputes
its KV (most of it usually still in the prefix cache). Preempting the newest and admitting
nobody in a step that preempted means the oldest request always progresses: nothing starves.

Pooling requests (embeddings: `SamplingOptions.pooling`) share the queues and the budget with
generation but only prefill: the step their prompt ends, they finish (STOP, no token) and free
their blocks, and the runner's pooled rows ride in that step's result. Only LAST pooling
starts from prefix-cache hits; MEAN, CLS and ALL read every prompt position's hidden state,
so they compute the whole prompt (their full blocks are still cached for others).
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Iterable

import numpy as np

from ....common.wire import PoolingType
from ....gpu import NewRequest, PromptLogprobs, RunnerOutput, StepBatch
from ...protocol._step_record import FinishReason
from .._grammar import GrammarState, GrammarViolationError
from ..kv._kv_cache_manager import KVCacheManager
from ._request import Request, RequestStatus
from ._scheduler_types import InvalidRequestError as InvalidRequestError
from ._scheduler_types import SchedulerConfig as SchedulerConfig
from ._scheduler_types import SchedulerConfigError as SchedulerConfigError
from ._scheduler_types import SchedulerStats as SchedulerStats
from ._scheduler_types import StepResult as StepResult
from ._spec_decode import SpecDecodingStats, usable_drafts


class Scheduler:
    """Owns the queues and the KV-cache manager; builds each `StepBatch` and applies its
    output. Call `update_from_output` once per batch, before the next `schedule`."""

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

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> StepBatch:
        """Decide this step: running requests first, then waiting ones, FCFS, in the budget;
        prompts (unfinished chunks, admissions) within what the decodes earned."""
        config, kv = self.config, self.kv_cache_manager
        budget = config.max_num_batched_tokens
        running = self.running
        num_decodes = sum(map(_is_decoding, running))
        pooling_budget = self._pooling_budget(num_decodes)  # pooling prompts' tokens
        prompt_tokens = 0  # computed for prompts (either kind): what they spend of the credit
        spec = config.speculative
        # Requests queued behind the running ones count: drafts spend compute they wait for.
        speculating = spec is not None and spec.speculates(len(running) + len(self.waiting))
        # The draft model writes K/V of its drafts past each step (`gpu.spec_decode._draft_model`).
        lookahead = spec.num_speculative_tokens if speculating and spec and spec.model else 0
        draft_counts: list[int] = []  # per scheduled row: the drafts it verifies
        draft_tokens: list[int] = []
        rnums: list[int] = []
        counts: list[int] = []
        grammar_rnums: list[int] = []  # rows that sample this step under a grammar
        cached_new_blocks: list[list[int]] = []
        cached_computed: list[int] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            # Running requests stay below max_model_len (check_stop), so this never passes it.
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            pooling = request.options.is_pooling
            if pooling:
                num_new = min(num_new, pooling_budget)
                if not num_new:
                    i += 1  # it waits for credit; the requests behind it go on
                    continue
            drafts = (
                usable_drafts(request, budget - num_new, config.max_model_len)
                if speculating
                and request.spec_token_ids
                and num_new == 1 == request.num_tokens - request.num_computed_tokens
                else []
            )
            request.spec_token_ids = []
            num_new += len(drafts)
            extra = self._lookahead(request, num_new, lookahead)
            while (new_blocks := kv.allocate_slots(request, num_new + extra)) is None:
                victim = running.pop()
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            if pooling:
                pooling_budget -= num_new
            if not _is_decoding(request):
                prompt_tokens += num_new
            rnums.append(request.rnum)
            counts.append(num_new)
            draft_counts.append(len(drafts))
            draft_tokens += drafts
            if (
                request.grammar is not None
                and request.num_computed_tokens + num_new >= request.num_tokens
            ):
                grammar_rnums.append(request.rnum)
            cached_new_blocks.append(new_blocks)
            cached_computed.append(request.num_computed_tokens)
            budget -= num_new
            i += 1
        num_cached = len(rnums)

        new_requests: list[NewRequest] = []
        # After a preemption blocks are short: admitting more would only preempt again.
        while not preempted and self.waiting and budget > 0 and len(running) < config.max_num_seqs:
            request = self.waiting[0]
            if request.options.is_pooling and not pooling_budget:
                # Generation passes pooling prompts that wait for credit; else the queue waits.
                request = next((r for r in self.waiting if not r.options.is_pooling), request)
                if request.options.is_pooling:
                    break
            if request.lora_id and not self._adapter_fits(request.lora_id):
                break  # FCFS: it waits until an adapter's last running request ends
            hits, num_hit_tokens = (
                ([], 0) if _needs_every_position(request) else kv.get_computed_blocks(request)
            )
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if request.options.is_pooling:
                num_new = min(num_new, pooling_budget)
            extra = self._lookahead(request, num_hit_tokens + num_new, lookahead)
            if kv.allocate_slots(request, num_new + extra, hits) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.remove(request)  # the head, but where a generation passed
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            running.append(request)
            new_requests.append(
                NewRequest(
                    request.rnum,
                    request.prompt_token_ids,
                    list(kv.get_block_ids(request.rnum)),
                    num_hit_tokens,
                    request.options,
                    list(request.output_token_ids),
                    request.prompt_embeds,
                    request.lora_id,
                )
            )
            rnums.append(request.rnum)
            counts.append(num_new)
            draft_counts.append(0)
            if request.grammar is not None and num_hit_tokens + num_new == request.num_tokens:
                grammar_rnums.append(request.rnum)
            budget -= num_new
            prompt_tokens += num_new
            if request.options.is_pooling:
                pooling_budget -= num_new
        if num_decodes:
            self.prefill_credit = max(0, self.prefill_credit - prompt_tokens)

        batch = StepBatch(
            self._step,
            new_requests=new_requests,
            cached_rnums=np.array(rnums[:num_cached], np.uint64),
            cached_new_block_ids=cached_new_blocks,
            cached_num_computed=np.array(cached_computed, np.int32),
            scheduled_rnums=np.array(rnums, np.uint64),
            num_scheduled_tokens=np.array(counts, np.int32),
            finished_rnums=np.array(self._finished_rnums, np.uint64),
            grammar_rnums=np.array(grammar_rnums, np.uint64),
        )
        if draft_tokens:
            batch.draft_offsets = np.zeros(len(draft_counts) + 1, np.int32)
            np.cumsum(draft_counts, out=batch.draft_offsets[1:])
            batch.draft_token_ids = np.array(draft_tokens, np.int32)
        if speculating and spec is not None:
            batch.num_speculative_tokens = spec.num_speculative_tokens
        self._finished_rnums = []
        self._step += 1
        return batch

    def _lookahead(self, request: Request, num_tokens: int, lookahead: int) -> int:
        """Slots past a step's `num_tokens` (computed after it) that a generation request
        reserves for the draft model's drafts, within `max_model_len`."""
        if not lookahead or request.options.is_pooling:
            return 0
        return max(0, min(lookahead, self.config.max_model_len - num_tokens))

    def grammar_drafts(self, batch: StepBatch) -> list[list[int]] | None:
        """The drafts of each of `batch.grammar_rnums`, in order (None: the step has none);
        their masks take a bitmask row per position."""
        if not len(batch.draft_token_ids) or not len(batch.grammar_rnums):
            return None
        offsets = batch.draft_offsets.tolist()
        tokens = batch.draft_token_ids.tolist()
        index = {r: i for i, r in enumerate(batch.scheduled_rnums.tolist())}
        bounds = [(offsets[index[r]], offsets[index[r] + 1]) for r in batch.grammar_rnums.tolist()]
        return [tokens[a:b] for a, b in bounds]

    def _adapter_fits(self, lora_id: int) -> bool:
        """Whether a request of adapter `lora_id` may run beside the running ones: its
        adapter is among theirs, or they hold fewer than `max_loras` (a step's slots)."""
        active = {r.lora_id for r in self.running if r.lora_id}
        return lora_id in active or len(active) < self.config.max_loras

    def _pooling_budget(self, num_decodes: int) -> int:
        """The pooling prompt tokens this step may compute: the whole budget without decodes
        (or without a cap); else, once the decodes' earnings are added, the credit if it
        covers the next pooling prompt in line whole (or is full), and none until it does."""
        config = self.config
        per_decode, most = config.max_prefill_tokens_per_decode, config.max_num_batched_tokens
        if not per_decode or not num_decodes:
            return most
        credit = self.prefill_credit = min(most, self.prefill_credit + per_decode * num_decodes)
        return credit if credit >= min(most, self._next_pooling_prompt()) else 0

    def _next_pooling_prompt(self) -> int:
        """Tokens the first pooling prompt in line still needs (an unfinished chunk's, else
        the first waiting one's, its prefix-cache hits not counted; 0: none)."""
        for request in itertools.chain(self.running, self.waiting):
            if request.options.is_pooling:
                return request.num_tokens - request.num_computed_tokens
        return 0

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and requeue it first; its outputs are kept, its
        KV is recomputed when it is admitted again. The caller removed it from `running`."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_rnums.append(request.rnum)  # the runner drops its row

    def update_from_output(self, batch: StepBatch, output: RunnerOutput) -> StepResult:
        """Apply a step's output: count computed tokens, cache newly full blocks, append the
        sampled tokens, finish (and free) what stopped. Tokens of requests aborted while the
        step ran are dropped."""
        requests, kv = self.requests, self.kv_cache_manager
        drafted = _drafts_by_rnum(batch)  # rows that verified drafts: cached once rolled back
        for rnum, count in zip(
            batch.scheduled_rnums.tolist(), batch.num_scheduled_tokens.tolist(), strict=True
        ):
            request = requests.get(rnum)
            if request is not None:
                request.num_computed_tokens += count
                if rnum not in drafted:
                    kv.cache_blocks(request)
        prompt_logprobs = self._new_prompt_logprobs(output.prompt_logprobs)
        pooled_done = self._finish_pooled(batch)

        max_model_len = self.config.max_model_len
        kept: list[int] | None = None  # row indices kept, once a row was dropped
        finish: list[int] = []
        num_cached: list[int] = []
        num_finished = 0
        runs = None
        single = zip(output.rnums.tolist(), output.token_ids.tolist(), strict=True)
        if output.token_offsets is not None:  # speculative: several tokens a row
            runs = self._apply_runs(output, drafted, finish, num_cached)
            num_finished = sum(1 for reason in finish if reason)
            single = zip([], [], strict=True)
        for i, (rnum, token_id) in enumerate(single):
            request = requests.get(rnum)
            if request is None:
                if kept is None:
                    kept = list(range(i))
                continue
            if kept is not None:
                kept.append(i)
            request.append_output_token(token_id)
            reason = request.check_stop(token_id, max_model_len)
            if request.grammar is not None and not reason:
                reason = _grammar_step(request.grammar, token_id, rnum)
            if reason:
                request.finish(reason)
                kv.free(request)
                del requests[rnum]
                self._finished_rnums.append(rnum)
                num_finished += 1
            finish.append(reason)
            num_cached.append(request.num_cached_tokens)
        if num_finished or pooled_done:
            self.running = [r for r in self.running if not r.is_finished]
        if output.draft_offsets is not None and output.draft_token_ids is not None:
            self._keep_drafts(output.rnums, output.draft_offsets, output.draft_token_ids)
        result = self._result(
            batch.step, output, kept, finish, num_cached, prompt_logprobs, pooled_done, runs
        )
        if pooled_done and output.pooled is not None and output.pooled_rnums is not None:
            # Rows of requests aborted while the step ran are dropped with them.
            keep = np.isin(output.pooled_rnums, [r.rnum for r in pooled_done])
            result.pooled_rnums = output.pooled_rnums[keep]
            result.pooled = output.pooled[keep]
        return result

    def _apply_runs(
        self,
        output: RunnerOutput,
        drafted: dict[int, int],
        finish: list[int],
        num_cached: list[int],
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Apply a step whose rows carry several tokens (accepted drafts, then one more):
        roll back the rejected drafts, append tokens until one ends the request (max_tokens,
        a stop token, the grammar's end: the rest of the run is dropped), cache full blocks.
        Returns the kept rows' and tokens' indices, and each kept row's count of tokens."""
        requests, kv = self.requests, self.kv_cache_manager
        max_model_len = self.config.max_model_len
        assert output.token_offsets is not None
        offsets = output.token_offsets.tolist()
        tokens = output.token_ids.tolist()
        row_index: list[int] = []
        token_index: list[int] = []
        counts: list[int] = []
        for i, rnum in enumerate(output.rnums.tolist()):
            request = requests.get(rnum)
            if request is None:  # aborted while the step ran
                continue
            run = tokens[offsets[i] : offsets[i + 1]]
            num_drafts = drafted.get(rnum, 0)
            if num_drafts:
                self.spec_stats.record(num_drafts, len(run) - 1)
                request.num_computed_tokens -= num_drafts - (len(run) - 1)
            reason = FinishReason.NONE
            taken = 0
            for token_id in run:
                request.append_output_token(token_id)
                taken += 1
                reason = request.check_stop(token_id, max_model_len)
                if request.grammar is not None and not reason:
                    reason = _grammar_step(request.grammar, token_id, rnum)
                if reason:
                    break
            # The K/V of tokens a stop cut off is no output's: not computed, never cached.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            kv.cache_blocks(request)
            if reason:
                request.finish(reason)
                kv.free(request)
                del requests[rnum]
                self._finished_rnums.append(rnum)
            row_index.append(i)
            token_index.extend(range(offsets[i], offsets[i] + taken))
            counts.append(taken)
            finish.append(reason)
            num_cached.append(request.num_cached_tokens)
        return np.array(row_index, np.intp), np.array(token_index, np.intp), counts

    def _keep_drafts(self, rnums: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> None:
        """Keep each live request's drafts for its next step (`schedule` checks them)."""
        bounds = offsets.tolist()
        for i, rnum in enumerate(rnums.tolist()):
            request = self.requests.get(rnum)
            if request is not None and bounds[i + 1] > bounds[i]:
                request.spec_token_ids = tokens[bounds[i] : bounds[i + 1]].tolist()

    def _finish_pooled(self, batch: StepBatch) -> list[Request]:
        """Finish (STOP) and free the pooling requests whose prompt this step completed.
        Only the live pooling requests are looked at: a generation-only step costs a set test."""
        if not self._pooling:
            return []
        done = []
        for rnum in batch.scheduled_rnums.tolist():
            request = self.requests.get(rnum) if rnum in self._pooling else None
            if request is not None and request.num_computed_tokens >= request.num_tokens:
                request.finish(FinishReason.STOP)
                self.kv_cache_manager.free(request)
                del self.requests[rnum]
                self._pooling.discard(rnum)
                self._finished_rnums.append(rnum)
                done.append(request)
        return done

    def _new_prompt_logprobs(
        self, prompt_logprobs: dict[int, PromptLogprobs]
    ) -> dict[int, PromptLogprobs]:
        """The prompt logprobs of live requests not reported before."""
        fresh = {}
        for rnum, chunk in prompt_logprobs.items():
            request = self.requests.get(rnum)
            if request is not None and (new := request.take_new_prompt_logprobs(chunk)):
                fresh[rnum] = new
        return fresh

    def _result(
        self,
        step: int,
        output: RunnerOutput,
        kept: list[int] | None,
        finish: list[int],
        num_cached: list[int],
        prompt_logprobs: dict[int, PromptLogprobs],
        pooled_done: list[Request],
        runs: tuple[np.ndarray, np.ndarray, list[int]] | None = None,
    ) -> StepResult:
        """Columns of the rows that produced a token, then one empty row per pooling request
        that ended and per abort."""
        rnums = np.asarray(output.rnums, np.uint64)
        tokens = np.asarray(output.token_ids, np.int32)
        logprobs, topk_ids, topk_logprobs = output.logprobs, output.topk_ids, output.topk_logprobs
        row_counts: list[int] | None = None
        if runs is not None:  # several tokens a row (speculative): the kept rows' kept tokens
            rows, index, row_counts = runs
            rnums = rnums[rows]
            tokens = tokens[index]
            logprobs = None if logprobs is None else logprobs[index]
            topk_ids = None if topk_ids is None else topk_ids[index]
            topk_logprobs = None if topk_logprobs is None else topk_logprobs[index]
        if kept is not None:
            index = np.array(kept, np.intp)
            rnums, tokens = rnums[index], tokens[index]
            logprobs = None if logprobs is None else logprobs[index]
            topk_ids = None if topk_ids is None else topk_ids[index]
            topk_logprobs = None if topk_logprobs is None else topk_logprobs[index]
        num_tokens = len(tokens)
        if pooled_done:
            rnums = np.concatenate([rnums, np.array([r.rnum for r in pooled_done], np.uint64)])
            finish.extend([FinishReason.STOP] * len(pooled_done))
            num_cached.extend(r.num_cached_tokens for r in pooled_done)
        if self._aborted:
            rnums = np.concatenate([rnums, np.array([r.rnum for r in self._aborted], np.uint64)])
            finish.extend(r.finish_reason for r in self._aborted)
            num_cached.extend(r.num_cached_tokens for r in self._aborted)
            self._aborted = []
        if row_counts is None:
            offsets = np.arange(len(rnums) + 1, dtype=np.uint32)
            offsets[num_tokens + 1 :] = num_tokens
        else:
            offsets = np.full(len(rnums) + 1, num_tokens, np.uint32)
            offsets[0] = 0
            np.cumsum(row_counts, out=offsets[1 : len(row_counts) + 1])
        return StepResult(
            step,
            rnums,
            offsets,
            tokens,
            np.array(finish, np.uint8),
            np.array(num_cached, np.uint32),
            logprobs,
            topk_ids,
            topk_logprobs,
            prompt_logprobs,
        )

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

    def empty_batch(self) -> StepBatch:
        """A step that schedules nothing (a flush: aborts and refused ADDs reported while
        paused or asleep), numbered in the one sequence `schedule` numbers steps in: the
        engine's STEP records and the scheduler's statistics then count the same steps."""
        batch = StepBatch(self._step)
        self._step += 1
        return batch

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


def _is_decoding(request: Request) -> bool:
    """Whether a running request computes one token this step to sample the next (not a
    prompt chunk, nor a preempted request recomputing its KV)."""
    return request.num_tokens - request.num_computed_tokens == 1 and not (
        request.options.is_pooling
    )


def _needs_every_position(request: Request) -> bool:
    """Whether `request` pools over every prompt position (MEAN, CLS, ALL), so prefix-cache
    hits cannot stand in for computing them."""
    return request.options.pooling not in (PoolingType.NONE, PoolingType.LAST)


def _grammar_step(grammar: GrammarState, token_id: int, rnum: int) -> FinishReason:
    """Advance a request's grammar by its new token: STOP once the grammar is complete
    (whatever `ignore_eos` says: nothing but EOS could follow), ERROR if the token broke it
    (logged: the client sees only `finish_reason: "error"`)."""
    try:
        return FinishReason.STOP if grammar.accept(token_id) else FinishReason.NONE
    except GrammarViolationError as exc:
        print(f"trillm engine: request {rnum} ended in error: {exc}", file=sys.stderr, flush=True)
        return FinishReason.ERROR


def _drafts_by_rnum(batch: StepBatch) -> dict[int, int]:
    """How many drafts each row of `batch` that verified some verified."""
    if not len(batch.draft_token_ids):
        return {}
    counts = np.diff(batch.draft_offsets).tolist()
    return {r: k for r, k in zip(batch.scheduled_rnums.tolist(), counts, strict=True) if k}
