"""`ModelRunner.execute_ahead` (async scheduling): a step runs before the last one's tokens
are read, its rows past them reading them where the sampler left them; a row given to
another request meanwhile is neither patched nor written by the late result."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trillm.gpu import ModelRunner, NewRequest, RunnerOutput, SamplingOptions, StepBatch

from .conftest import make_runner

# Greedy: the tiny model's next token follows its input (sampled ones drown it in noise).
GREEDY = SamplingOptions(temperature=0.0, ignore_eos=True)
PROMPT_A = [11, 12, 13, 14, 15, 16]  # its two tokens land at positions 6 and 7
PROMPT_B = [40, 41, 42, 43, 44, 45, 46, 47]  # its last position, 7, is A's second token's


def steps() -> list[StepBatch]:
    """A's prompt, A's decode (one row: max_num_seqs 1), then A ends and B takes its row."""
    first = StepBatch(0, new_requests=[NewRequest(1, PROMPT_A, [0], 0, GREEDY)])
    first.scheduled_rnums = np.array([1], np.uint64)
    first.num_scheduled_tokens = np.array([6], np.int32)
    second = StepBatch(1)
    second.cached_rnums = np.array([1], np.uint64)
    second.cached_new_block_ids = [[]]
    second.cached_num_computed = np.array([6], np.int32)
    second.scheduled_rnums = np.array([1], np.uint64)
    second.num_scheduled_tokens = np.array([1], np.int32)
    third = StepBatch(
        2,
        new_requests=[NewRequest(2, PROMPT_B, [1], 0, GREEDY)],
        finished_rnums=np.array([1], np.uint64),
    )
    third.scheduled_rnums = np.array([2], np.uint64)
    third.num_scheduled_tokens = np.array([8], np.int32)
    return [first, second, third]


def tokens(outputs: list[RunnerOutput]) -> list[list[int]]:
    return [o.token_ids.tolist() for o in outputs]


def test_steps_ahead_give_the_synchronous_tokens_and_spare_a_reused_row(
    tiny_model_dir: Path,
) -> None:
    sync: ModelRunner = make_runner(tiny_model_dir, max_num_seqs=1)
    expected = [sync.execute(batch) for batch in steps()]
    runner: ModelRunner = make_runner(tiny_model_dir, max_num_seqs=1)
    first, second, third = steps()
    pending_first = runner.execute_ahead(first)
    pending_second = runner.execute_ahead(second)  # its input: the first's token, unread
    got = [pending_first.result()]
    pending_third = runner.execute_ahead(third)  # A ended: B took its row
    got += [pending_second.result(), pending_third.result()]
    assert tokens(got) == tokens(expected)
    row = runner.inputs.row_of[2]
    assert runner.inputs.token_ids[row, : len(PROMPT_B)].tolist() == PROMPT_B
    assert runner.inputs.num_tokens[row] == len(PROMPT_B) + 1
