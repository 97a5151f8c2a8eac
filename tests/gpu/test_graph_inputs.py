"""`GraphInputs`: the decode graphs' inputs padded on the host and carried by one copy from
a mirror into the static buffers (CPU tensors here; on CUDA the mirrors are pinned)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trillm.gpu.runner._graph_inputs import GraphInputs


def _step(b: int, width: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(3, 1000, b),  # token ids
        rng.integers(0, 500, b),  # positions
        rng.integers(0, 4000, b),  # slots
        rng.integers(1, 500, b).astype(np.int32),  # context lengths
        rng.integers(0, 250, (b, width)).astype(np.int32),  # block tables
    )


def test_a_step_lands_padded_in_the_static_buffers() -> None:
    inputs = GraphInputs(8, 6, torch.device("cpu"))
    ids, positions, slots, lens, table = _step(3, 4, 0)
    inputs.fill(4, ids, positions, slots, lens, table)
    assert inputs.input_ids[:4].tolist() == [*ids, 0]
    assert inputs.positions[:4].tolist() == [*positions, 0]
    assert inputs.slots[:4].tolist() == [*slots, -1]  # the padding row writes nothing
    assert inputs.seq_lens[:4].tolist() == [*lens, 0]  # and reads nothing
    assert torch.equal(inputs.block_tables[:3, :4], torch.from_numpy(table))
    assert inputs.slots[4:].tolist() == [-1] * 4  # rows never filled


def test_the_copy_is_the_prefix_the_size_reads_and_the_mirrors_alternate() -> None:
    inputs = GraphInputs(8, 6, torch.device("cpu"))
    big = _step(8, 6, 1)
    inputs.fill(8, *big)
    small = _step(2, 3, 2)
    inputs.fill(2, *small)  # the other mirror: its rows past 2 are still the initial ones
    assert inputs.input_ids[:2].tolist() == small[0].tolist()
    assert torch.equal(inputs.block_tables[:2, :3], torch.from_numpy(small[4]))
    # table rows past the size were not copied: still the 8-row step's
    assert torch.equal(inputs.block_tables[2:], torch.from_numpy(big[4][2:]))
    inputs.fill(1, *_step(1, 6, 3))  # back to the first mirror, which held the 8-row step
    assert inputs.seq_lens[1:].tolist() == big[3][1:].tolist()  # unread rows: stale, harmless
    assert inputs.buffer.data_ptr() == inputs.input_ids.data_ptr()  # views of one buffer


@pytest.mark.parametrize(
    ("b", "size", "width"), [(3, 2, 4), (3, 9, 4), (3, 4, 7)], ids=["rows", "size", "width"]
)
def test_a_step_that_does_not_fit_is_refused(b: int, size: int, width: int) -> None:
    inputs = GraphInputs(8, 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit the graphs' inputs"):
        inputs.fill(size, *_step(b, width, 4))


@pytest.mark.parametrize(("b", "width"), [(1, 1), (64, 128), (256, 128), (64, 1024)])
def test_a_steps_copies_grow_with_its_batch_and_longest_sequence_not_max_model_len(
    b: int, width: int
) -> None:
    """Issue 48, item 8: at a 131,072-token max_model_len (8,192 blocks of 16) every replay
    copied 4 x rows x 8,192 bytes of table. Now the table's bytes are 4 x B x width, twice
    (to the device packed, then into the graphs' rows), beside the small parts' 28 x n."""
    n, max_blocks = 256, 8192
    inputs = GraphInputs(n, max_blocks, torch.device("cpu"))
    step = _step(b, width, 5)
    inputs.fill(b, *step)
    assert inputs.copied_bytes == 28 * n + 2 * 4 * b * width
    assert torch.equal(inputs.block_tables[:b, :width], torch.from_numpy(step[4]))
    narrower = _step(b, max(1, width // 2), 6)  # a later, shorter step: its own columns
    inputs.fill(b, *narrower)
    assert torch.equal(inputs.block_tables[:b, : width // 2 or 1], torch.from_numpy(narrower[4]))
