"""Applying a step's output to the scheduler: tokens appended, stops found, blocks freed.

The half of `Scheduler` that runs after the forward (nano-vllm's `postprocess`), apart from
the half that decides the step (`_scheduler`) so that each reads alone: `update_from_output`
counts computed tokens, caches newly full blocks, appends the sampled tokens (several a row
once drafts were verified), advances grammars, finishes what stopped and builds the step's
`StepResult`, with a row per abort since the last one.
"""

from __future__ import annotations

import sys

import numpy as np

from ....gpu import PromptLogprobs, RunnerOutput, StepBatch
from ...protocol._step_record import FinishReason
from .._grammar import GrammarState, GrammarViolationError
from ._queues import SchedulerQueues
from ._request import Request
from ._scheduler_types import StepResult


class Postprocessor(SchedulerQueues):
    """`SchedulerQueues` plus applying a step's output (`update_from_output`)."""

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
