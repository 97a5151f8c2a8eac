"""The device contract's wire forms round-trip exactly."""

from __future__ import annotations

import numpy as np

from trillm.gpu import (
    NewRequest,
    PromptLogprobs,
    RunnerOutput,
    RunnerOutputCodec,
    SamplingOptions,
    StepBatch,
    StepBatchCodec,
)


def test_step_batch_round_trips() -> None:
    batch = StepBatch(
        7,
        new_requests=[NewRequest(5, [1, 2, 3], [0, 1], 0, SamplingOptions(top_k=5, seed=3))],
        cached_rnums=np.array([9, 2**63], np.uint64),
        cached_new_block_ids=[[4], []],
        cached_num_computed=np.array([17, 3], np.int32),
        scheduled_rnums=np.array([5, 9, 2**63], np.uint64),
        num_scheduled_tokens=np.array([3, 1, 1], np.int32),
        finished_rnums=np.array([11], np.uint64),
    )
    codec = StepBatchCodec()
    buffer = bytearray()
    codec.encode_into(batch, buffer)
    got = codec.decode(bytes(buffer))
    assert got.step == 7 and got.new_requests == batch.new_requests
    for name in ("cached_rnums", "cached_num_computed", "scheduled_rnums", "finished_rnums"):
        assert getattr(got, name).tolist() == getattr(batch, name).tolist()
    assert got.cached_new_block_ids == [[4], []]


def test_runner_output_round_trips_with_logprobs() -> None:
    out = RunnerOutput(
        np.array([3, 4], np.uint64),
        np.array([10, 20], np.int32),
        np.array([-0.5, -1.5], np.float32),
        np.array([[10, 1], [20, 2]], np.int32),
        np.array([[-0.5, -2.0], [-1.5, -3.0]], np.float32),
        {
            3: PromptLogprobs(1, np.array([-1.0, -2.0], np.float32), None, None),
            4: PromptLogprobs(
                2,
                np.array([-1.0], np.float32),
                np.array([[7, 8, 9]], np.int32),
                np.array([[-1.0, -2.0, -3.0]], np.float32),
            ),
        },
    )
    codec = RunnerOutputCodec()
    buffer = bytearray()
    codec.encode_into(out, buffer)
    got = codec.decode(bytes(buffer))
    assert got.rnums.tolist() == [3, 4] and got.token_ids.tolist() == [10, 20]
    assert got.topk_ids is not None and got.topk_ids.tolist() == [[10, 1], [20, 2]]
    assert got.prompt_logprobs[3].logprobs.tolist() == [-1.0, -2.0]
    assert got.prompt_logprobs[3].topk_ids is None
    topk = got.prompt_logprobs[4].topk_ids
    assert topk is not None and topk.tolist() == [[7, 8, 9]]


def test_runner_output_round_trips_the_requests_that_failed_alone() -> None:
    out = RunnerOutput(np.array([3], np.uint64), np.array([10], np.int32))
    out.failed = {4: "LoRA adapter 'a': no adapter this server can read at 'x'"}
    codec = RunnerOutputCodec()
    buffer = bytearray()
    codec.encode_into(out, buffer)
    assert codec.decode(bytes(buffer)).failed == out.failed
    buffer.clear()
    codec.encode_into(RunnerOutput(out.rnums, out.token_ids), buffer)
    assert codec.decode(bytes(buffer)).failed == {}
