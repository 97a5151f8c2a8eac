"""The scheduler, driven step by step by a fake runner that checks the device contract.

`FakeRunner` reads each `StepBatch` the way the model runner does (rows by rnum, new requests,
new block ids, scheduled counts) and simulates the KV cache: every computed position writes
the identity of its whole prefix into its slot, and every step first checks that each
request's already-computed positions still hold its own prefix. A wrong prefix-cache hit, a
block shared while written, or a block reused while held shows up as a mismatch. Its token
at each position depends only on (rnum, position), so preemption must not change outputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trillm.engine.core.executor._executor import NullExecutor
from trillm.engine.core.sched._request import Request, RequestStatus
from trillm.engine.core.sched._scheduler import (
    InvalidRequestError,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    StepResult,
)
from trillm.engine.protocol import FinishReason
from trillm.gpu import ModelConfig, PromptLogprobs, RunnerOutput, SamplingOptions, StepBatch

VOCAB = 12


def token_of(rnum: int, position: int) -> int:
    return (rnum * 7 + position * 5) % VOCAB + 10


@dataclass
class Row:
    tokens: list[int]
    blocks: list[int]
    computed: int
    prefix: list[int] = field(default_factory=list)  # identity of tokens[: p + 1]

    def content(self, position: int) -> int:
        while len(self.prefix) <= position:
            parent = self.prefix[-1] if self.prefix else 0
            self.prefix.append(hash((parent, self.tokens[len(self.prefix)])))
        return self.prefix[position]


class FakeRunner:
    """The model runner's reading of a StepBatch, with a simulated KV cache (see above)."""

    def __init__(
        self, scheduler: Scheduler, token_fn: Callable[[int, int], int] = token_of
    ) -> None:
        self.scheduler = scheduler
        self.config = scheduler.config
        self.token_fn = token_fn
        self.rows: dict[int, Row] = {}
        self.kv: dict[int, int] = {}  # slot -> content
        self.new_requests: list[tuple[int, list[int]]] = []  # (rnum, outputs) ever sent new

    def slot(self, row: Row, position: int) -> int:
        bs = self.config.block_size
        return row.blocks[position // bs] * bs + position % bs

    def execute(self, batch: StepBatch) -> RunnerOutput:
        config, kv = self.config, self.scheduler.kv_cache_manager
        for rnum in batch.finished_rnums.tolist():
            self.rows.pop(rnum, None)
        for new in batch.new_requests:
            tokens = [*new.prompt_token_ids, *new.output_token_ids]
            self.rows[new.rnum] = Row(tokens, list(new.block_ids), new.num_computed_tokens)
            self.new_requests.append((new.rnum, list(new.output_token_ids)))
        for rnum, blocks, computed in zip(
            batch.cached_rnums.tolist(),
            batch.cached_new_block_ids,
            batch.cached_num_computed.tolist(),
            strict=True,
        ):
            row = self.rows[rnum]
            row.blocks.extend(blocks)
            assert row.computed == computed
        assert len(self.rows) <= config.max_num_seqs
        rnums, counts = batch.scheduled_rnums.tolist(), batch.num_scheduled_tokens.tolist()
        assert len(set(rnums)) == len(rnums) <= config.max_num_seqs
        assert sum(counts) <= config.max_num_batched_tokens
        writes: dict[int, int] = {}
        for rnum, count in zip(rnums, counts, strict=True):
            row = self.rows[rnum]
            assert row.blocks == kv.get_block_ids(rnum)
            end = row.computed + count
            assert count >= 1 and end <= len(row.tokens) < config.max_model_len
            assert end <= len(row.blocks) * config.block_size
            for position in range(row.computed):  # the KV it attends to is its own
                assert self.kv.get(self.slot(row, position)) == row.content(position)
            for position in range(row.computed, end):
                slot = self.slot(row, position)
                assert slot not in writes
                assert kv.pool.ref_counts[slot // config.block_size] == 1  # never shared
                writes[slot] = row.content(position)
        self.kv.update(writes)
        sampled, tokens = [], []
        for rnum, count in zip(rnums, counts, strict=True):
            row = self.rows[rnum]
            row.computed += count
            if row.computed == len(row.tokens):
                token = self.token_fn(rnum, len(row.tokens))
                row.tokens.append(token)
                sampled.append(rnum)
                tokens.append(token)
        return RunnerOutput(np.array(sampled, np.uint64), np.array(tokens, np.int32))


def make_config(**kw: int | bool) -> SchedulerConfig:
    values: dict[str, int | bool] = dict(
        num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64
    )
    values.update(kw)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def make_request(
    rnum: int,
    prompt: list[int] | int,
    max_tokens: int = 8,
    eos: int | None = None,
    **options: object,
) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(
        rnum,
        tokens,
        SamplingOptions(**options),
        max_tokens,
        eos_token_id=eos,  # type: ignore[arg-type]
    )


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[StepBatch, StepResult]:
    batch = scheduler.schedule()
    return batch, scheduler.update_from_output(batch, runner.execute(batch))


def rows_of(result: StepResult) -> dict[int, tuple[list[int], int]]:
    offsets = result.tok_offsets.tolist()
    return {
        rnum: (result.tokens[offsets[i] : offsets[i + 1]].tolist(), int(result.finish[i]))
        for i, rnum in enumerate(result.rnums.tolist())
    }


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000
) -> dict[int, tuple[list[int], int]]:
    outputs: dict[int, tuple[list[int], int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        _, result = step(scheduler, runner)
        for rnum, (tokens, finish) in rows_of(result).items():
            outputs[rnum] = (outputs.get(rnum, ([], 0))[0] + tokens, finish)
    raise AssertionError("requests did not finish")


def scheduled(batch: StepBatch) -> dict[int, int]:
    return dict(
        zip(batch.scheduled_rnums.tolist(), batch.num_scheduled_tokens.tolist(), strict=True)
    )


# -- budget, chunked prefill, max_num_seqs --------------------------------------------------


def test_decodes_are_scheduled_first_and_a_long_prompt_is_chunked() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=10))
    runner = FakeRunner(scheduler)
    for rnum in (1, 2, 3):
        scheduler.add_request(make_request(rnum, 2, max_tokens=20))
    batch, result = step(scheduler, runner)
    assert scheduled(batch) == {1: 2, 2: 2, 3: 2} and result.num_rows == 3
    scheduler.add_request(make_request(4, 20))
    chunks = []
    for _ in range(3):
        batch, result = step(scheduler, runner)
        counts = scheduled(batch)
        assert [counts[r] for r in (1, 2, 3)] == [1, 1, 1]  # the decodes never wait
        chunks.append(counts[4])
        assert (4 in rows_of(result)) == (sum(chunks) == 20)
    assert chunks == [7, 7, 6]
    assert batch.cached_rnums.tolist() == [1, 2, 3, 4]
    assert batch.cached_num_computed.tolist()[3] == 14


def test_budget_smaller_than_the_running_set_serves_the_oldest_first() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=4))
    runner = FakeRunner(scheduler)
    for rnum in (1, 2, 3):
        scheduler.add_request(make_request(rnum, 2, max_tokens=3))
    assert scheduled(step(scheduler, runner)[0]) == {1: 2, 2: 2}
    assert scheduled(step(scheduler, runner)[0]) == {1: 1, 2: 1, 3: 2}
    outputs = run_to_completion(scheduler, runner)
    assert {rnum: len(tokens) for rnum, (tokens, _) in outputs.items()} == {1: 1, 2: 1, 3: 2}


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = Scheduler(make_config(max_num_seqs=2))
    runner = FakeRunner(scheduler)
    for rnum in (1, 2, 3):
        scheduler.add_request(make_request(rnum, 3, max_tokens=2))
    batch, _ = step(scheduler, runner)
    assert scheduled(batch) == {1: 3, 2: 3} and scheduler.num_waiting == 1
    batch, result = step(scheduler, runner)
    assert rows_of(result)[1][1] == FinishReason.LENGTH and scheduler.num_running == 0
    batch, _ = step(scheduler, runner)
    assert batch.finished_rnums.tolist() == [1, 2] and scheduled(batch) == {3: 3}


# -- prefix caching --------------------------------------------------------------------------


def test_a_repeated_prompt_hits_the_cache_exactly_in_tokens() -> None:
    scheduler = Scheduler(make_config())
    runner = FakeRunner(scheduler)
    prompt = list(range(100, 110))  # two full blocks of 4, two tokens more
    scheduler.add_request(make_request(1, prompt, max_tokens=20))
    step(scheduler, runner)
    scheduler.add_request(make_request(2, prompt, max_tokens=20))
    batch, result = step(scheduler, runner)
    [new] = batch.new_requests
    assert new.num_computed_tokens == 8 and scheduled(batch)[2] == 2
    assert rows_of(result)[2][0] and result.num_cached_tokens.tolist() == [0, 8]
    kv = scheduler.kv_cache_manager
    shared = kv.get_block_ids(1)[:2]
    assert kv.get_block_ids(2)[:2] == shared
    assert [kv.pool.ref_counts[b] for b in shared] == [2, 2]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (20, 8)
    stats = scheduler.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_a_fully_cached_prompt_computes_its_last_block_again() -> None:
    scheduler = Scheduler(make_config())
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 8, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request(2, 8, max_tokens=1))
    batch, _ = step(scheduler, runner)
    assert batch.new_requests[0].num_computed_tokens == 4 and scheduled(batch) == {2: 4}


def test_without_prefix_caching_nothing_is_shared() -> None:
    scheduler = Scheduler(make_config(enable_prefix_caching=False))
    runner = FakeRunner(scheduler)
    for rnum in (1, 2):
        scheduler.add_request(make_request(rnum, 10, max_tokens=2))
        run_to_completion(scheduler, runner)
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (0, 0)
    assert runner.new_requests == [(1, []), (2, [])]


# -- preemption ------------------------------------------------------------------------------


def test_preempted_requests_finish_with_the_tokens_they_would_have_had() -> None:
    def run(num_blocks: int) -> tuple[dict[int, tuple[list[int], int]], Scheduler, FakeRunner]:
        scheduler = Scheduler(make_config(num_blocks=num_blocks, max_model_len=24))
        runner = FakeRunner(scheduler)
        for rnum in range(1, 5):
            scheduler.add_request(make_request(rnum, [rnum] * 6, max_tokens=14))
        return run_to_completion(scheduler, runner), scheduler, runner

    expected, roomy, _ = run(64)
    outputs, tight, runner = run(6)
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert outputs == expected
    assert all(finish == FinishReason.LENGTH for _, finish in outputs.values())
    resumed = [(rnum, out) for rnum, out in runner.new_requests if out]
    assert resumed  # readmitted with the outputs generated before the preemption
    for rnum, out in resumed:
        assert out == expected[rnum][0][: len(out)]
    assert tight.kv_cache_manager.num_free_blocks == 6


def test_preemption_takes_the_newest_and_tells_the_runner() -> None:
    scheduler = Scheduler(make_config(num_blocks=4, max_model_len=16, max_num_batched_tokens=64))
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 7, max_tokens=8))
    scheduler.add_request(make_request(2, 7, max_tokens=8))
    step(scheduler, runner)  # each holds 2 blocks; all 4 are used
    batch, _ = step(scheduler, runner)  # both reach 8 computed; need a third block next
    scheduler.add_request(make_request(3, 1, max_tokens=1))
    batch, _ = step(scheduler, runner)
    assert scheduled(batch) == {1: 1}  # and nobody admitted in a step that preempted
    assert batch.finished_rnums.tolist() == [2]
    preempted, _ = scheduler.waiting
    assert preempted.rnum == 2 and preempted.status is RequestStatus.PREEMPTED
    assert preempted.num_computed_tokens == 0 and preempted.num_output_tokens == 2
    assert scheduler.statistics().num_preemptions == 1


def test_a_request_that_is_itself_the_newest_preempts_itself() -> None:
    scheduler = Scheduler(make_config(num_blocks=2, max_model_len=8, max_num_batched_tokens=8))
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 4, max_tokens=4))
    step(scheduler, runner)  # holds 1 block, 5 tokens known
    scheduler.kv_cache_manager.pool.take(1)  # someone else holds the last block
    batch, _ = step(scheduler, runner)
    assert scheduled(batch) == {} and batch.finished_rnums.tolist() == [1]
    assert scheduler.num_running == 0 and scheduler.waiting[0].rnum == 1


def test_preemption_through_the_null_executor_keeps_lengths() -> None:
    model = ModelConfig("llama", 1000, 8, 8, 1, 1, 1, 8, 1e-5, 1e4, 64, True, False, False)
    executor = NullExecutor(model, num_blocks=8, max_model_len=32)
    scheduler = Scheduler(make_config(num_blocks=8, max_model_len=32, max_num_batched_tokens=16))
    for rnum in range(10):
        scheduler.add_request(make_request(rnum, 5 + rnum, max_tokens=12))
    lengths: Counter[int] = Counter()
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        batch = scheduler.schedule()
        result = scheduler.update_from_output(batch, executor.execute(batch))
        lengths.update(result.rnums.tolist())
    assert scheduler.num_preemptions > 0
    assert lengths == {rnum: 12 for rnum in range(10)}
    assert scheduler.kv_cache_manager.num_free_blocks == 8


# -- abort -----------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once_and_is_reported_once() -> None:
    scheduler = Scheduler(make_config(num_blocks=16))
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 9, max_tokens=10))
    scheduler.add_request(make_request(2, 3, max_tokens=10))
    scheduler.add_request(make_request(3, 3, max_tokens=10))
    step(scheduler, runner)
    [aborted] = scheduler.abort_requests([1])
    assert aborted.finish_reason is FinishReason.ABORT and aborted.is_finished
    assert scheduler.kv_cache_manager.num_free_blocks == 16 - 2
    batch, result = step(scheduler, runner)
    assert batch.finished_rnums.tolist() == [1]
    rows = rows_of(result)
    assert rows[1] == ([], FinishReason.ABORT) and result.rnums.tolist()[-1] == 1
    assert 1 not in rows_of(step(scheduler, runner)[1])


def test_abort_of_unknown_or_finished_requests_is_harmless() -> None:
    scheduler = Scheduler(make_config())
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 3, max_tokens=1))
    run_to_completion(scheduler, runner)
    assert scheduler.abort_requests([1, 99, np.uint64(7)]) == []
    assert step(scheduler, runner)[1].num_rows == 0


def test_tokens_of_requests_aborted_during_the_step_are_dropped() -> None:
    scheduler = Scheduler(make_config())
    runner = FakeRunner(scheduler)
    for rnum in (1, 2):
        scheduler.add_request(make_request(rnum, 3, max_tokens=5))
    batch = scheduler.schedule()
    output = runner.execute(batch)
    output.logprobs = np.array([-1.0, -2.0], np.float32)
    output.topk_ids = np.array([[5], [6]], np.int32)
    output.topk_logprobs = np.array([[-0.5], [-0.6]], np.float32)
    scheduler.abort_requests([1])
    result = scheduler.update_from_output(batch, output)
    assert result.rnums.tolist() == [2, 1]
    assert result.tok_offsets.tolist() == [0, 1, 1]
    assert result.finish.tolist() == [0, FinishReason.ABORT]
    assert result.logprobs is not None and result.logprobs.tolist() == [-2.0]
    assert result.topk_ids is not None and result.topk_ids.tolist() == [[6]]
    assert scheduler.schedule().finished_rnums.tolist() == [1]


def test_aborting_a_waiting_request_never_reaches_the_runner() -> None:
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request(1, 3))
    assert [r.rnum for r in scheduler.abort_requests([1])] == [1]
    assert scheduler.num_waiting == 0 and not scheduler.has_unfinished_requests()
    batch = scheduler.schedule()
    assert batch.finished_rnums.tolist() == [] and not batch.new_requests
    result = scheduler.update_from_output(
        batch, RunnerOutput(np.zeros(0, np.uint64), np.zeros(0, np.int32))
    )
    assert rows_of(result) == {1: ([], FinishReason.ABORT)}


# -- stop conditions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "tokens", "finish"),
    [
        (dict(max_tokens=4), [3, 4, 5, 6], FinishReason.LENGTH),
        (dict(eos=5), [3, 4, 5], FinishReason.STOP),
        (dict(eos=5, ignore_eos=True, max_tokens=4), [3, 4, 5, 6], FinishReason.LENGTH),
        (dict(stop_token_ids=(5,)), [3, 4, 5], FinishReason.STOP),
        (dict(stop_token_ids=(4, 6), min_tokens=3), [3, 4, 5, 6], FinishReason.STOP),
        (dict(eos=4, min_tokens=2), [3, 4], FinishReason.STOP),
        (dict(eos=3, min_tokens=2, max_tokens=3), [3, 4, 5], FinishReason.LENGTH),
        (dict(eos=5, max_tokens=3), [3, 4, 5], FinishReason.STOP),  # stop wins over length
        (dict(max_tokens=100), [3, 4, 5, 6, 7], FinishReason.LENGTH),  # max_model_len 8
    ],
)
def test_stop_conditions(kw: dict[str, object], tokens: list[int], finish: FinishReason) -> None:
    scheduler = Scheduler(make_config(max_model_len=8))
    runner = FakeRunner(scheduler, token_fn=lambda rnum, position: position)
    scheduler.add_request(make_request(1, 3, **{"max_tokens": 8, **kw}))  # type: ignore[arg-type]
    outputs = run_to_completion(scheduler, runner)
    assert outputs == {1: (tokens, finish)}
    assert scheduler.kv_cache_manager.num_free_blocks == 64


# -- results ---------------------------------------------------------------------------------


def test_prompt_logprobs_are_passed_once_even_after_a_recompute() -> None:
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request(1, 10, prompt_logprobs=0))
    scheduler.schedule()
    batch = StepBatch(1)  # nothing computed: only the prompt logprobs matter here

    def chunk(first: int, n: int) -> PromptLogprobs:
        return PromptLogprobs(first, np.arange(first, first + n, dtype=np.float32), None, None)

    empty = (np.zeros(0, np.uint64), np.zeros(0, np.int32))
    result = scheduler.update_from_output(
        batch, RunnerOutput(*empty, prompt_logprobs={1: chunk(1, 4)})
    )
    assert result.prompt_logprobs[1].first_position == 1
    result = scheduler.update_from_output(
        batch, RunnerOutput(*empty, prompt_logprobs={1: chunk(1, 6)})
    )
    [(rnum, fresh)] = result.prompt_logprobs.items()
    assert (rnum, fresh.first_position, fresh.logprobs.tolist()) == (1, 5, [5.0, 6.0])
    result = scheduler.update_from_output(
        batch, RunnerOutput(*empty, prompt_logprobs={1: chunk(1, 6)})
    )
    assert result.prompt_logprobs == {}


# -- validation ------------------------------------------------------------------------------


def test_config_errors_say_what_to_change() -> None:
    with pytest.raises(SchedulerConfigError, match=r"^block_size must be >= 1, got 0$"):
        make_config(block_size=0)
    with pytest.raises(SchedulerConfigError, match=r"max_model_len must be >= 2"):
        make_config(max_model_len=1)
    with pytest.raises(
        SchedulerConfigError,
        match=r"^the KV cache holds 16 tokens \(4 blocks of 4\), fewer than one request of "
        r"max_model_len 64: lower max_model_len to at most 16 or give the KV cache more memory$",
    ):
        make_config(num_blocks=4)


def test_requests_that_can_never_run_are_refused() -> None:
    scheduler = Scheduler(make_config(max_model_len=8))
    scheduler.add_request(make_request(1, 3))
    with pytest.raises(InvalidRequestError, match=r"^request number 1 is already in use$"):
        scheduler.add_request(make_request(1, 3))
    with pytest.raises(InvalidRequestError, match=r"empty prompt: send at least one token"):
        scheduler.add_request(make_request(2, []))
    with pytest.raises(
        InvalidRequestError,
        match=r"^request 3 has 8 prompt tokens, leaving no room to generate within "
        r"max_model_len 8: send at most 7$",
    ):
        scheduler.add_request(make_request(3, 8))
    with pytest.raises(InvalidRequestError, match=r"max_tokens 0: ask for >= 1"):
        scheduler.add_request(make_request(4, 3, max_tokens=0))
    assert scheduler.unfinished_rnums() == [1]


# -- random sequences ------------------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9], list(range(20, 32))]
MACHINE_CONFIG = SchedulerConfig(
    num_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=32
)


def expected_outputs(request: Request) -> tuple[list[int], FinishReason]:
    """What the request must produce, from its definition alone."""
    options, outputs = request.options, []
    while True:
        token = token_of(request.rnum, request.num_prompt_tokens + len(outputs))
        outputs.append(token)
        n = len(outputs)
        if n >= options.min_tokens and (
            (token == request.eos_token_id and not options.ignore_eos)
            or token in options.stop_token_ids
        ):
            return outputs, FinishReason.STOP
        if n >= request.max_tokens or request.num_prompt_tokens + n >= MACHINE_CONFIG.max_model_len:
            return outputs, FinishReason.LENGTH


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler = Scheduler(MACHINE_CONFIG)
        self.runner = FakeRunner(self.scheduler)
        self.requests: dict[int, Request] = {}
        self.outputs: dict[int, list[int]] = {}
        self.finish: dict[int, int] = {}
        self.to_report: set[int] = set()  # aborted, row not seen yet
        self.admitted: set[int] = set()
        self.queries = self.hits = 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=10),
        max_tokens=st.integers(1, 24),
        eos=st.none() | st.integers(10, 10 + VOCAB - 1),
        stop=st.none() | st.integers(10, 10 + VOCAB - 1),
        min_tokens=st.integers(0, 3),
    )
    def add(
        self,
        prefix: list[int],
        suffix: list[int],
        max_tokens: int,
        eos: int | None,
        stop: int | None,
        min_tokens: int,
    ) -> None:
        rnum = len(self.requests) + 1
        prompt = ([*prefix, *suffix] or [0])[: MACHINE_CONFIG.max_model_len - 1]
        options = SamplingOptions(
            min_tokens=min_tokens, stop_token_ids=() if stop is None else (stop,)
        )
        request = Request(rnum, prompt, options, max_tokens, eos_token_id=eos)
        self.requests[rnum] = request
        self.outputs[rnum] = []
        self.scheduler.add_request(request)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rnum = data.draw(st.sampled_from([*self.requests, 10**9]))
        was_live = rnum in self.requests and not self.requests[rnum].is_finished
        aborted = self.scheduler.abort_requests([rnum])
        assert [r.rnum for r in aborted] == ([rnum] if was_live else [])
        if was_live:
            self.to_report.add(rnum)

    @rule()
    def step(self) -> None:
        batch = self.scheduler.schedule()
        self.apply(batch, self.scheduler.update_from_output(batch, self.runner.execute(batch)))

    @precondition(lambda self: self.scheduler.num_running > 0)
    @rule(data=st.data())
    def abort_during_step(self, data: st.DataObject) -> None:
        batch = self.scheduler.schedule()
        output = self.runner.execute(batch)
        if len(batch.scheduled_rnums):
            rnum = data.draw(st.sampled_from(batch.scheduled_rnums.tolist()))
            assert self.scheduler.abort_requests([rnum])
            self.to_report.add(rnum)
        self.apply(batch, self.scheduler.update_from_output(batch, output))

    @rule()
    def reset_prefix_cache(self) -> None:
        held = self.scheduler.kv_cache_manager.num_free_blocks < MACHINE_CONFIG.num_blocks
        assert self.scheduler.reset_prefix_cache() is not held

    def apply(self, batch: StepBatch, result: StepResult) -> None:
        for new in batch.new_requests:
            request = self.requests[new.rnum]
            assert new.output_token_ids == self.outputs[new.rnum]
            if new.rnum not in self.admitted:
                self.admitted.add(new.rnum)
                self.queries += request.num_prompt_tokens
                self.hits += new.num_computed_tokens
                assert request.num_cached_tokens == new.num_computed_tokens
        for rnum, (tokens, finish) in rows_of(result).items():
            request = self.requests[rnum]
            if finish == FinishReason.ABORT:
                assert tokens == [] and rnum in self.to_report
                self.to_report.discard(rnum)
            else:
                assert len(tokens) == 1 and rnum not in self.finish
                self.outputs[rnum] += tokens
            if finish:
                self.finish[rnum] = finish
                assert request.finish_reason == finish
        assert not self.to_report

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        kv = self.scheduler.kv_cache_manager
        pool, holders = kv.pool, Counter[int]()
        running = {r.rnum for r in self.scheduler.running}
        for rnum in running:
            blocks = kv.get_block_ids(rnum)
            assert len(set(blocks)) == len(blocks)
            holders.update(blocks)
        for block in range(pool.num_blocks):
            assert pool.ref_counts[block] == holders[block]
            assert pool.is_free(block) == (holders[block] == 0)
        assert pool.num_free_blocks + len(holders) == pool.num_blocks
        for request in self.requests.values():
            if request.rnum not in running:
                assert kv.get_block_ids(request.rnum) == []

    @invariant()
    def every_request_is_in_one_place(self) -> None:
        waiting = [r.rnum for r in self.scheduler.waiting]
        running = [r.rnum for r in self.scheduler.running]
        assert len(running) <= MACHINE_CONFIG.max_num_seqs
        for rnum, request in self.requests.items():
            places = (waiting.count(rnum), running.count(rnum), int(request.is_finished))
            assert sum(places) == 1, (rnum, places)
            if places[0]:
                assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if places[1]:
                assert request.status is RequestStatus.RUNNING
        unfinished = {r.rnum for r in self.requests.values() if not r.is_finished}
        assert set(self.scheduler.unfinished_rnums()) == unfinished

    @invariant()
    def prefix_counters_match_a_recount(self) -> None:
        assert self.scheduler.prefix_cache_queries == self.queries
        assert self.scheduler.prefix_cache_hits == self.hits

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        assert not self.scheduler.has_unfinished_requests()
        assert self.scheduler.kv_cache_manager.num_free_blocks == MACHINE_CONFIG.num_blocks
        for rnum, request in self.requests.items():
            assert request.is_finished
            expected, reason = expected_outputs(request)
            if request.finish_reason is FinishReason.ABORT:
                assert self.outputs[rnum] == expected[: len(self.outputs[rnum])]
            else:
                assert (self.outputs[rnum], self.finish[rnum]) == (expected, reason)
                assert request.output_token_ids == expected


SchedulerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_machine = SchedulerMachine.TestCase
