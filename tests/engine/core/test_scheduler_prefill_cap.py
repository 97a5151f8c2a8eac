"""The prefill cap (`max_prefill_tokens_per_decode`): while decodes run, each step earns credit
per decode and pooling prompts run whole once it covers them, so over any run they get at most
the rate; every decode still runs every step; with no decode a prompt takes the whole budget;
credit saved while decoding serves a burst at once; generation prompts are not held back (they
pass embeddings that wait) but spend the credit; and under a random workload the credit keeps
count and nothing starves."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings

from trillm.common.wire import PoolingType
from trillm.engine.core.sched._request import Request
from trillm.engine.core.sched._scheduler import Scheduler, SchedulerConfigError
from trillm.gpu import StepBatch

from .test_scheduler import MACHINE_CONFIG, FakeRunner, SchedulerMachine, make_config, make_request
from .test_scheduler_pooling import PoolingRunner


def capped(per_decode: int, **kw: int) -> Scheduler:
    """A scheduler under the cap, without prefix caching (the prompts here share prefixes)."""
    config = make_config(
        max_prefill_tokens_per_decode=per_decode, enable_prefix_caching=False, **kw
    )
    return Scheduler(config)


def run(scheduler: Scheduler, runner: FakeRunner) -> StepBatch:
    batch = scheduler.schedule()
    scheduler.update_from_output(batch, runner.execute(batch))
    return batch


def counts(batch: StepBatch) -> dict[int, int]:
    return dict(
        zip(batch.scheduled_rnums.tolist(), batch.num_scheduled_tokens.tolist(), strict=True)
    )


def decoding(scheduler: Scheduler, runner: FakeRunner, *rnums: int) -> None:
    """Add short generations `rnums` and step until each has sampled (so each decodes next)."""
    for rnum in rnums:
        scheduler.add_request(make_request(rnum, 2, max_tokens=40))
    while any(not scheduler.requests[r].output_token_ids for r in rnums):
        run(scheduler, runner)


def embedding(rnum: int, length: int) -> Request:
    return make_request(rnum, length, pooling=PoolingType.MEAN)


def test_a_pooling_prompt_runs_whole_once_the_decodes_earned_its_tokens() -> None:
    scheduler = capped(2)
    runner = PoolingRunner(scheduler)
    decoding(scheduler, runner, 1, 2, 3)
    scheduler.prefill_credit = 0
    scheduler.add_request(embedding(4, 20))  # 29 tokens of budget are free every step
    steps = [counts(run(scheduler, runner)) for _ in range(4)]
    # 3 decodes earn 6 tokens a step: 6, 12, 18, then 24 >= 20 and the prompt runs whole
    assert steps == [{1: 1, 2: 1, 3: 1}] * 3 + [{1: 1, 2: 1, 3: 1, 4: 20}]
    assert scheduler.prefill_credit == 4 and 4 not in scheduler.requests  # pooled, done


def test_over_many_steps_pooling_gets_at_most_the_rate_and_every_decode_runs() -> None:
    scheduler = capped(2)
    runner = PoolingRunner(scheduler)
    decoding(scheduler, runner, 1, 2)
    scheduler.prefill_credit = 0
    for rnum in range(10, 30):
        scheduler.add_request(make_request(rnum, 12, pooling=PoolingType.LAST))
    prompt_tokens = []
    for _ in range(30):
        step = counts(run(scheduler, runner))
        assert step[1] == step[2] == 1  # the decodes run every step
        prompt_tokens.append(sum(n for r, n in step.items() if r >= 10))
    # 2 decodes x 2 = 4 tokens a step, spent in whole prompts of 12 every third step
    assert prompt_tokens == [0, 0, 12] * 10
    assert sorted(set(range(10, 30)) - set(scheduler.requests)) == list(range(10, 20))


def test_without_decodes_prompts_take_the_whole_budget() -> None:
    scheduler = capped(1)
    runner = PoolingRunner(scheduler)
    scheduler.add_request(embedding(1, 40))
    scheduler.add_request(embedding(2, 10))
    assert counts(run(scheduler, runner)) == {1: 32}
    assert counts(run(scheduler, runner)) == {1: 8, 2: 10}
    assert scheduler.prefill_credit == 0


def test_a_pooling_prompt_longer_than_the_budget_runs_once_the_credit_is_full() -> None:
    scheduler = capped(4, max_num_batched_tokens=16, max_model_len=64)
    runner = PoolingRunner(scheduler)
    decoding(scheduler, runner, 1)
    scheduler.prefill_credit = 0
    scheduler.add_request(embedding(2, 40))
    steps = [counts(run(scheduler, runner)) for _ in range(6)]
    # 4 a step up to the budget's 16; then a chunk of what the decode leaves, 15
    assert steps == [{1: 1}] * 3 + [{1: 1, 2: 15}] + [{1: 1}] * 2


def test_credit_saved_while_decoding_lets_a_burst_run_at_once() -> None:
    scheduler = capped(4)
    runner = PoolingRunner(scheduler)
    decoding(scheduler, runner, 1)
    for _ in range(8):  # 8 quiet decode steps: 32 tokens of credit, the budget
        run(scheduler, runner)
    assert scheduler.prefill_credit == 32
    scheduler.add_request(embedding(2, 10))
    scheduler.add_request(embedding(3, 10))
    assert counts(run(scheduler, runner)) == {1: 1, 2: 10, 3: 10}


def test_a_generation_prompt_passes_the_flood_and_spends_the_credit() -> None:
    scheduler = capped(4)
    runner = PoolingRunner(scheduler)
    decoding(scheduler, runner, 1)
    scheduler.prefill_credit = 0
    scheduler.add_request(embedding(10, 8))
    scheduler.add_request(make_request(2, 12))
    # the embedding waits for credit; the generation behind it is not held back
    assert counts(run(scheduler, runner)) == {1: 1, 2: 12}
    assert scheduler.prefill_credit == 0  # 4 earned, 12 spent: none left, none owed
    steps = [counts(run(scheduler, runner)) for _ in range(2)]
    # 2 decodes now earn 8 a step: the embedding's 8 in the next step
    assert steps == [{1: 1, 2: 1, 10: 8}, {1: 1, 2: 1}]


def test_generation_prompts_fill_the_budget_as_without_a_cap() -> None:
    scheduler = capped(1)
    runner = FakeRunner(scheduler)
    decoding(scheduler, runner, 1)
    scheduler.add_request(make_request(2, 40))
    assert counts(run(scheduler, runner)) == {1: 1, 2: 31}


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(SchedulerConfigError, match=r"max_prefill_tokens_per_decode must be >= 0"):
        make_config(max_prefill_tokens_per_decode=-1)


CAPPED_CONFIG = replace(MACHINE_CONFIG, max_prefill_tokens_per_decode=1)  # the strictest


class CappedSchedulerMachine(SchedulerMachine):
    """The scheduler's state machine (outputs, blocks, queues, prefix counters, everything
    finishes) under the strictest cap, which every step must keep."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = scheduler = Scheduler(CAPPED_CONFIG)
        self.runner = FakeRunner(scheduler)
        schedule = scheduler.schedule

        def checked() -> StepBatch:
            decoding = {
                r.rnum for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1
            }
            earned = min(
                scheduler.prefill_credit + len(decoding), CAPPED_CONFIG.max_num_batched_tokens
            )
            batch = schedule()
            if decoding:  # the credit keeps count of what prompts spent
                spent = sum(n for r, n in counts(batch).items() if r not in decoding)
                assert scheduler.prefill_credit == max(0, earned - spent)
            return batch

        scheduler.schedule = checked  # type: ignore[method-assign]


CappedSchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_capped_scheduler_machine = CappedSchedulerMachine.TestCase
