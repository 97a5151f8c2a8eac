"""The STEP record's pooled section: one contiguous float32 block and its rnums, as views."""

from __future__ import annotations

import numpy as np

from trillm.engine.protocol._step_record import StepView, write_step
from trillm.gpu import RunnerOutput, RunnerOutputCodec

from .test_protocol import ring_pair


def test_pooled_block_rides_after_every_other_section() -> None:
    writer, reader = ring_pair()
    block = np.arange(3 * 5, dtype=np.float32).reshape(3, 5) / 7
    with writer, reader:
        write_step(
            writer,
            3,
            np.array([7, 8], np.uint64),
            np.array([0, 1, 1], np.uint32),
            np.array([42], np.int32),
            np.array([0, 1], np.uint8),
            num_cached_tokens=np.array([0, 16], np.uint32),
            pooled_rnums=np.array([8, 8, 8], np.uint64),  # ALL pooling: a row per token
            pooled=block,
        )
        view = StepView(reader.peek(timeout=0)[1])
        assert view.tokens.tolist() == [42] and view.finish.tolist() == [0, 1]
        assert view.num_cached_tokens is not None and view.num_cached_tokens.tolist() == [0, 16]
        assert view.pooled_rnums is not None and view.pooled_rnums.tolist() == [8, 8, 8]
        assert view.pooled is not None and np.array_equal(view.pooled, block)
        assert view.pooled.ctypes.data % 8 == 0
        del view
        reader.release()


def test_a_step_without_pooling_has_no_pooled_section() -> None:
    writer, reader = ring_pair()
    with writer, reader:
        write_step(
            writer,
            1,
            np.array([5], np.uint64),
            np.array([0, 1], np.uint32),
            np.array([9], np.int32),
            np.zeros(1, np.uint8),
        )
        view = StepView(reader.peek(timeout=0)[1])
        assert view.pooled is None and view.pooled_rnums is None
        del view
        reader.release()


def test_runner_output_carries_the_pooled_block_to_the_executor() -> None:
    out = RunnerOutput(
        np.array([3], np.uint64),
        np.array([10], np.int32),
        pooled_rnums=np.array([4, 5], np.uint64),
        pooled=np.array([[0.5, 1.0, 2.0], [3.0, 4.0, 5.0]], np.float32),
    )
    codec = RunnerOutputCodec()
    buffer = bytearray()
    codec.encode_into(out, buffer)
    got = codec.decode(bytes(buffer))
    assert got.pooled_rnums is not None and got.pooled_rnums.tolist() == [4, 5]
    assert got.pooled is not None and got.pooled.tolist() == [[0.5, 1.0, 2.0], [3.0, 4.0, 5.0]]
    codec.encode_into(RunnerOutput(np.zeros(0, np.uint64), np.zeros(0, np.int32)), buffer)
    assert codec.decode(bytes(buffer)).pooled is None
