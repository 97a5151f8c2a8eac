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

import numpy as np

from ....common.wire import PoolingType
from ....gpu import NewRequest, StepBatch
from ._postprocess import Postprocessor
from ._request import Request, RequestStatus
from ._scheduler_types import InvalidRequestError as InvalidRequestError
from ._scheduler_types import SchedulerConfig as SchedulerConfig
from ._scheduler_types import SchedulerConfigError as SchedulerConfigError
from ._scheduler_types import SchedulerStats as SchedulerStats
from ._scheduler_types import StepResult as StepResult
from ._spec_decode import usable_drafts


class Scheduler(Postprocessor):
    """Owns the queues and the KV-cache manager; builds each `StepBatch` and applies its
    output. Call `update_from_output` once per batch, before the next `schedule`.

    Deciding a step is here; the queues and requests in and out are `SchedulerQueues`'
    (`_queues`), applying a step's output `Postprocessor`'s (`_postprocess`).
    """

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

    def empty_batch(self) -> StepBatch:
        """A step that schedules nothing (a flush: aborts and refused ADDs reported while
        paused or asleep), numbered in the one sequence `schedule` numbers steps in: the
        engine's STEP records and the scheduler's statistics then count the same steps."""
        batch = StepBatch(self._step)
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
