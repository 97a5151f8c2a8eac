"""Pooling requests in the scheduler: prefill only, finished the step their prompt ends,
beside generation in the same steps; only LAST pooling starts from prefix-cache hits."""

from __future__ import annotations

import numpy as np
import pytest

from trillm.common.wire import PoolingType
from trillm.engine.core.sched._scheduler import InvalidRequestError, Scheduler
from trillm.engine.protocol import FinishReason
from trillm.gpu import RunnerOutput, StepBatch

from .test_scheduler import FakeRunner, make_config, make_request, rows_of, scheduled


class PoolingRunner(FakeRunner):
    """The fake runner, whose pooling rows sample nothing and return one pooled row each
    (the rnum in every column) once their prompt is computed."""

    def execute(self, batch: StepBatch) -> RunnerOutput:
        pooling = {r.rnum for r in batch.new_requests if r.options.is_pooling}
        self.pooling = getattr(self, "pooling", set()) | pooling
        out = super().execute(batch)
        keep = [i for i, r in enumerate(out.rnums.tolist()) if r not in self.pooling]
        done = [r for r in out.rnums.tolist() if r in self.pooling]
        return RunnerOutput(
            out.rnums[keep],
            out.token_ids[keep],
            pooled_rnums=np.array(done, np.uint64) if done else None,
            pooled=np.array([[r, r, r] for r in done], np.float32) if done else None,
        )


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[StepBatch, object]:
    batch = scheduler.schedule()
    return batch, scheduler.update_from_output(batch, runner.execute(batch))


def test_a_pooling_request_ends_with_its_prompt_beside_a_generation() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=10))
    runner = PoolingRunner(scheduler)
    scheduler.add_request(make_request(1, 3, max_tokens=20))
    scheduler.add_request(make_request(2, 15, pooling=PoolingType.MEAN))
    batch = scheduler.schedule()
    result = scheduler.update_from_output(batch, runner.execute(batch))
    assert scheduled(batch) == {1: 3, 2: 7}  # chunked like any prompt
    assert set(rows_of(result)) == {1} and result.pooled is None
    batch = scheduler.schedule()
    result = scheduler.update_from_output(batch, runner.execute(batch))
    assert scheduled(batch) == {1: 1, 2: 8}
    rows = rows_of(result)
    assert rows[2] == ([], FinishReason.STOP) and len(rows[1][0]) == 1
    assert result.pooled_rnums is not None and result.pooled_rnums.tolist() == [2]
    assert result.pooled is not None and result.pooled.tolist() == [[2.0, 2.0, 2.0]]
    assert 2 not in scheduler.requests and scheduler.num_running == 1
    assert not scheduler.kv_cache_manager.get_block_ids(2)  # freed at once
    assert scheduler.schedule().finished_rnums.tolist() == [2]  # the runner drops its row


@pytest.mark.parametrize("kind", list(PoolingType)[1:])
def test_only_last_pooling_reads_the_prefix_cache(kind: PoolingType) -> None:
    scheduler = Scheduler(make_config())
    runner = PoolingRunner(scheduler)
    scheduler.add_request(make_request(1, 12, max_tokens=1))
    step(scheduler, runner)
    scheduler.add_request(make_request(2, 12, pooling=kind))
    batch, _ = step(scheduler, runner)
    hit = kind is PoolingType.LAST
    assert scheduled(batch) == {2: 4 if hit else 12}
    assert batch.new_requests[0].num_computed_tokens == (8 if hit else 0)


def test_a_pooling_prompt_may_fill_max_model_len() -> None:
    scheduler = Scheduler(make_config(max_model_len=16))
    scheduler.add_request(make_request(1, 16, pooling=PoolingType.LAST))
    with pytest.raises(InvalidRequestError, match="send at most 16"):
        scheduler.add_request(make_request(2, 17, pooling=PoolingType.LAST))
    with pytest.raises(InvalidRequestError, match="send at most 15"):
        scheduler.add_request(make_request(3, 16))


def test_an_abort_during_the_step_drops_its_pooled_row() -> None:
    scheduler = Scheduler(make_config())
    runner = PoolingRunner(scheduler)
    scheduler.add_request(make_request(1, 5, pooling=PoolingType.LAST))
    scheduler.add_request(make_request(2, 5, pooling=PoolingType.LAST))
    batch = scheduler.schedule()
    output = runner.execute(batch)
    scheduler.abort_requests([1])
    result = scheduler.update_from_output(batch, output)
    assert rows_of(result) == {2: ([], FinishReason.STOP), 1: ([], FinishReason.ABORT)}
    assert result.pooled_rnums is not None and result.pooled_rnums.tolist() == [2]


def test_an_aborted_pooling_rnum_reused_by_a_generation_generates() -> None:
    """A pooling request's rnum forgotten on abort: the generation that takes the number next
    runs to its max_tokens, and is not finished as a pooled prompt once its prompt is in."""
    scheduler = Scheduler(make_config())
    runner = PoolingRunner(scheduler)
    scheduler.add_request(make_request(1, 12, pooling=PoolingType.MEAN))
    scheduler.abort_requests([1])
    _, result = step(scheduler, runner)  # reports the abort
    assert rows_of(result)[1] == ([], FinishReason.ABORT)  # type: ignore[arg-type]
    runner.pooling = set()
    scheduler.add_request(make_request(1, 4, max_tokens=3))
    outputs = []
    for _ in range(3):
        _, result = step(scheduler, runner)
        outputs.append(rows_of(result)[1])  # type: ignore[arg-type]
    assert [len(tokens) for tokens, _ in outputs] == [1, 1, 1]
    assert outputs[-1][1] == FinishReason.LENGTH
