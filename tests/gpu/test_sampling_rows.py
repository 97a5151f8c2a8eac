"""The runner's per-row sampling columns (`_sampling_rows`) and rows lookup (`_input_batch`):
a step's batch from the columns is `SamplingBatch.build`'s from the states, whatever the mix
of options, rows and order; the counters follow adds and removes; plain greedy costs no row."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.common.wire import SamplingOptions
from trillm.gpu._step_batch import NewRequest
from trillm.gpu.runner._input_batch import InputBatch
from trillm.gpu.sample._sampling_batch import RequestSamplingState, SamplingBatch
from trillm.gpu.sample._sampling_rows import SamplingRows

CPU = torch.device("cpu")
VOCAB = 64
EOS = 2

OPTIONS = st.builds(
    SamplingOptions,
    temperature=st.sampled_from([0.0, 0.0, 1.0, 0.7]),
    top_k=st.sampled_from([0, 0, 5, 100]),
    top_p=st.sampled_from([1.0, 1.0, 0.9]),
    min_p=st.sampled_from([0.0, 0.0, 0.1]),
    seed=st.sampled_from([None, None, 7]),
    logprobs=st.sampled_from([None, None, 0, 3]),
    logit_bias=st.sampled_from([(), (), ((5, 1.5), (9, -2.0))]),
    min_tokens=st.sampled_from([0, 0, 2]),
    stop_token_ids=st.sampled_from([(), (11,)]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.3]),
)


def same(a: Any, b: Any) -> bool:
    """Equal records: tensors by value, generators by identity, the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, torch.Generator):
        return a is b
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@settings(max_examples=60, deadline=None)
@given(
    options=st.lists(OPTIONS, min_size=1, max_size=8),
    data=st.data(),
)
def test_a_batch_from_the_columns_is_the_batch_from_the_states(
    options: list[SamplingOptions], data: st.DataObject
) -> None:
    table = SamplingRows(16)
    rows = data.draw(st.permutations(range(16)))[: len(options)]
    states = [RequestSamplingState(o, np.arange(1, 6, dtype=np.int32), CPU) for o in options]
    for row, state in zip(rows, states, strict=True):
        table.add(row, state)
        state.output_token_ids.extend([3, 4])
    order = data.draw(st.permutations(range(len(options))))
    step = [order[i] for i in range(data.draw(st.integers(1, len(options))))]
    step_rows = np.array([rows[i] for i in step], np.int64)
    got = table.batch(step_rows, eos_token_id=EOS, vocab_size=VOCAB, device=CPU)
    want = SamplingBatch.build(
        [states[i] for i in step], eos_token_id=EOS, vocab_size=VOCAB, device=CPU
    )
    assert same(got, want), (got, want)


def test_counters_follow_adds_and_removes_and_plain_greedy_gathers_nothing() -> None:
    table = SamplingRows(4)
    greedy = RequestSamplingState(SamplingOptions(temperature=0.0), [], CPU)
    seeded = RequestSamplingState(
        SamplingOptions(temperature=1.0, seed=3, logprobs=1, min_tokens=2), [], CPU
    )
    table.add(0, greedy)
    table.add(1, seeded)
    assert (table.num_rows, table.num_random, table.num_logprobs) == (2, 1, 1)
    assert (table.num_special, table.num_history, table.num_seeded) == (1, 1, 1)
    table.remove(1)
    table.remove(1)  # an empty row: ignored
    assert (table.num_rows, table.num_random, table.num_special, table.num_seeded) == (1, 0, 0, 0)
    batch = table.batch(np.array([0], np.int64), eos_token_id=EOS, vocab_size=VOCAB, device=CPU)
    assert batch == SamplingBatch.greedy(1, VOCAB)
    table.add(0, seeded)  # a row taken again: the old request is counted out
    assert (table.num_rows, table.num_random, table.num_seeded) == (1, 1, 1)


def test_outputs_are_appended_only_to_states_that_read_them() -> None:
    table = SamplingRows(4)
    plain = RequestSamplingState(SamplingOptions(temperature=0.8), [], CPU)
    penalised = RequestSamplingState(SamplingOptions(frequency_penalty=0.5), [], CPU)
    table.add(2, plain)
    table.add(3, penalised)
    table.append_outputs(np.array([3, 2], np.int64), np.array([7, 8], np.int32))
    assert plain.output_token_ids == [] and penalised.output_token_ids == [7]


def test_rows_of_finds_rows_after_adds_and_removes() -> None:
    inputs = InputBatch(8, 64, 16)

    def add(rnum: int) -> int:
        return inputs.add(NewRequest(rnum, [1, 2, 3], [0], 0))

    rows = {rnum: add(rnum) for rnum in (2**63 + 5, 7, 40)}
    got = inputs.rows_of(np.array([40, 2**63 + 5, 7], np.uint64))
    assert got.tolist() == [rows[40], rows[2**63 + 5], rows[7]]
    inputs.remove(7)
    rows[9] = add(9)
    assert inputs.rows_of(np.array([9, 40], np.int64)).tolist() == [rows[9], rows[40]]
    with pytest.raises(KeyError, match=r"requests \[7\] have no row"):
        inputs.rows_of(np.array([40, 7], np.uint64))
    assert inputs.rows_of(np.zeros(0, np.uint64)).tolist() == []


def test_a_decode_step_flattens_as_a_mixed_step_does() -> None:
    """`prepare`'s one-token-each path gives the arrays of the general one (which a step
    with one more token, at the end, takes)."""
    inputs = InputBatch(8, 128, 4)
    for rnum, (prompt, computed) in enumerate([(9, 8), (5, 4), (14, 13), (3, 2)]):
        blocks = [10 * rnum + b for b in range(4)]
        inputs.add(NewRequest(rnum, list(range(100, 100 + prompt)), blocks, computed))
    inputs.add(NewRequest(9, [1, 2, 3], [50], 0))
    rnums = np.array([2, 0, 3, 1], np.uint64)
    decode = inputs.prepare(rnums, np.ones(4, np.int32))
    mixed = inputs.prepare(np.append(rnums, 9), np.array([1, 1, 1, 1, 2], np.int32))
    for name in ("rows", "counts", "token_starts", "context_lens", "samples"):
        assert getattr(decode, name).tolist() == getattr(mixed, name)[:4].tolist(), name
    for name in ("input_ids", "positions", "slots"):
        got, want = getattr(decode, name), getattr(mixed, name)[:4]
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name
    # position p of request r: block 10 r + p // 4, slot 4 * block + p % 4
    assert decode.slots.tolist() == [23 * 4 + 1, 2 * 4 + 0, 30 * 4 + 2, 11 * 4 + 0]
