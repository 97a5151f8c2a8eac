"""The async scheduler driven step by step: placeholders in and out, stops found a step late,
preemption with a placeholder, aborts in flight, and the steps that stay synchronous.

The fake runner of `test_scheduler` checks the device contract and the KV cache; it runs
each step at once, as the multiprocess executor does, while the scheduler applies each
output one step late, as the engine does with `--async-scheduling`.
"""

from __future__ import annotations

import pytest

from trillm.engine.core.sched._async_scheduler import AsyncScheduler, StepsInFlightError
from trillm.engine.core.sched._request import RequestStatus
from trillm.engine.core.sched._scheduler import Scheduler
from trillm.engine.protocol import FinishReason
from trillm.gpu import RunnerOutput, StepBatch

from .test_scheduler import FakeRunner, make_config, make_request, rows_of, run_to_completion

Outputs = dict[int, tuple[list[int], int]]


def run_ahead(scheduler: AsyncScheduler, runner: FakeRunner, max_steps: int = 1000) -> Outputs:
    """The engine's loop: schedule N+1 and execute it, then apply N."""
    outputs: Outputs = {}
    pending: tuple[StepBatch, RunnerOutput] | None = None
    num_ahead = 0

    def apply(batch: StepBatch, output: RunnerOutput) -> None:
        for rnum, (tokens, finish) in rows_of(scheduler.update_from_output(batch, output)).items():
            outputs[rnum] = (outputs.get(rnum, ([], 0))[0] + tokens, finish)

    for _ in range(max_steps):
        if pending is not None and not (
            scheduler.may_schedule_ahead() and scheduler.has_schedulable_requests()
        ):
            apply(*pending)
            pending = None
        if not scheduler.has_unfinished_requests():
            assert num_ahead > 0 and scheduler.num_in_flight == 0
            return outputs
        batch = scheduler.schedule()
        output = runner.execute(batch)
        if pending is not None:
            apply(*pending)
            pending = None
        if scheduler.is_ahead(batch):
            pending, num_ahead = (batch, output), num_ahead + 1
        else:
            apply(batch, output)
    raise AssertionError("requests did not finish")


def add_requests(scheduler: Scheduler) -> None:
    """Prompts of 1 to 14 tokens, max_tokens 1 to 12, EOS (13) for some: it comes when
    `token_of` gives it, so those stop before max_tokens."""
    for rnum in range(1, 9):
        eos = 13 if rnum % 3 == 0 else None
        scheduler.add_request(make_request(rnum, [rnum] * (rnum * 2 - 1), rnum + 4, eos=eos))


@pytest.mark.parametrize("num_blocks", [64, 7])  # 7: preemptions, some with a placeholder
def test_ahead_outputs_equal_the_synchronous_ones(num_blocks: int) -> None:
    sync = Scheduler(make_config(num_blocks=num_blocks, max_model_len=26))
    add_requests(sync)
    expected = run_to_completion(sync, FakeRunner(sync))
    ahead = AsyncScheduler(make_config(num_blocks=num_blocks, max_model_len=26))
    add_requests(ahead)
    assert run_ahead(ahead, FakeRunner(ahead)) == expected
    assert {finish for _, finish in expected.values()} == {FinishReason.STOP, FinishReason.LENGTH}
    assert (ahead.num_preemptions > 0) == (num_blocks == 7)
    assert ahead.kv_cache_manager.num_free_blocks == num_blocks


def test_a_placeholder_counts_as_a_token_until_its_output_replaces_it() -> None:
    scheduler = AsyncScheduler(make_config())
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 3, max_tokens=2))
    (request,) = scheduler.waiting
    first = scheduler.schedule()
    assert scheduler.is_ahead(first)
    assert request.num_computed_tokens == 3 and request.num_output_placeholders == 1
    assert request.num_tokens == 4 and request.num_output_tokens == 0
    first_out = runner.execute(first)
    second = scheduler.schedule()  # before the first output: one token past the placeholder
    assert second.num_scheduled_tokens.tolist() == [1]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 4
    second_out = runner.execute(second)
    result = scheduler.update_from_output(first, first_out)
    assert rows_of(result) == {1: (first_out.token_ids.tolist(), FinishReason.NONE)}
    assert request.num_output_placeholders == 1 and request.output_token_ids == [
        first_out.token_ids.tolist()[0]
    ]
    # The token in flight is its last (max_tokens 2): no step may be scheduled past it.
    assert not scheduler.may_schedule_ahead()
    with pytest.raises(StepsInFlightError, match="call update_from_output for them"):
        scheduler.schedule()
    result = scheduler.update_from_output(second, second_out)
    assert rows_of(result)[1][1] == FinishReason.LENGTH and request.num_output_tokens == 2
    assert request.num_output_placeholders == 0 and not scheduler.has_unfinished_requests()


def test_a_stop_found_late_drops_the_row_computed_past_it() -> None:
    scheduler = AsyncScheduler(make_config())
    runner = FakeRunner(scheduler, token_fn=lambda rnum, position: 13)  # EOS at once
    scheduler.add_request(make_request(1, 3, max_tokens=8, eos=13))
    first = scheduler.schedule()
    first_out = runner.execute(first)
    second = scheduler.schedule()  # scheduled before the stop is known
    second_out = runner.execute(second)
    assert rows_of(scheduler.update_from_output(first, first_out)) == {1: ([13], FinishReason.STOP)}
    result = scheduler.update_from_output(second, second_out)
    assert second_out.rnums.tolist() == [1] and result.num_rows == 0  # its token is dropped
    assert scheduler.schedule().finished_rnums.tolist() == [1]  # the runner drops the row
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_an_abort_in_flight_drops_the_pending_token_and_reports_the_abort() -> None:
    scheduler = AsyncScheduler(make_config())
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 5, max_tokens=8))
    scheduler.add_request(make_request(2, 5, max_tokens=8))
    first = scheduler.schedule()
    first_out = runner.execute(first)
    scheduler.abort_requests([1])
    result = scheduler.update_from_output(first, first_out)
    assert rows_of(result) == {
        2: (first_out.token_ids.tolist()[1:], FinishReason.NONE),
        1: ([], FinishReason.ABORT),
    }
    assert scheduler.schedule().finished_rnums.tolist() == [1]


def test_preemption_with_a_placeholder_recomputes_from_the_known_tokens() -> None:
    scheduler = AsyncScheduler(make_config(num_blocks=4, max_model_len=16))
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 7, max_tokens=8))
    scheduler.add_request(make_request(2, 7, max_tokens=8))
    first = scheduler.schedule()  # both prompts: 2 blocks each, all 4 used
    first_out = runner.execute(first)
    second = scheduler.schedule()  # both decode position 7: still in their second block
    second_out = runner.execute(second)
    scheduler.update_from_output(first, first_out)
    third = scheduler.schedule()  # position 8 needs a third block each: 2 is preempted
    victim = scheduler.requests[2]
    assert third.scheduled_rnums.tolist() == [1] and 2 in third.finished_rnums.tolist()
    assert victim.status is RequestStatus.PREEMPTED and victim.num_output_placeholders == 1
    third_out = runner.execute(third)
    result = scheduler.update_from_output(second, second_out)  # the victim's token arrives
    assert sorted(result.rnums.tolist()) == [1, 2]
    assert victim.num_output_placeholders == 0 and victim.num_output_tokens == 2
    assert victim.num_tokens == 9 and victim.num_computed_tokens == 0
    scheduler.update_from_output(third, third_out)
    outputs = run_ahead(scheduler, runner)
    readmitted = [out for rnum, out in runner.new_requests if rnum == 2 and out]
    assert readmitted[0] == victim.output_token_ids[:2]  # recomputed from what was known
    assert len(outputs[2][0]) == 6 and outputs[2][1] == FinishReason.LENGTH


def test_a_request_that_reads_its_outputs_keeps_the_steps_synchronous() -> None:
    scheduler = AsyncScheduler(make_config())
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(1, 3, max_tokens=4))
    scheduler.add_request(make_request(2, 3, max_tokens=4, frequency_penalty=0.5))
    batch = scheduler.schedule()
    assert not scheduler.is_ahead(batch) and scheduler.requests[1].num_output_placeholders == 0
    scheduler.update_from_output(batch, runner.execute(batch))
    scheduler.abort_requests([2])
    assert scheduler.may_schedule_ahead()  # the penalized request ended
    assert scheduler.is_ahead(scheduler.schedule())
