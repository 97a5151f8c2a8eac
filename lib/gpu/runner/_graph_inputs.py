"""The decode graphs' static inputs: one device buffer, filled by one copy a step from a
persistent pinned mirror, padded on the host.

Why: the graphs replay over fixed addresses, so each step's inputs must land in the same
buffers. Uploading each array to a fresh device tensor (a pinned allocation and a copy each)
and then copying it, and the padding rows' fills, into the static buffers cost five host-to-
device copies, five device-to-device copies and up to four fill kernels a step. Here the
host writes the step's arrays and their padding into a pinned mirror with numpy, and one
non-blocking copy carries them into the buffer the graphs read.

Layout (n the largest captured batch, W the block table's width for `max_model_len`; every
part starts on an 8-byte boundary):

    mirrors and device: | input_ids n x i64 | positions n x i64 | slots n x i64 |
                        | seq_lens n x i32 | pad | packed table: up to n x W i32 |
    device only:        | block_tables n x W x i32 (row-major: what the graphs read) |

A step of B decodes, padded to size s, writes its [B, width] table (width: its longest
sequence's blocks) packed, row after row, so the bytes it needs are a prefix of the mirror:
the four small parts whole (28 bytes a row of n) and 4 x B x width bytes of table. One
host-to-device copy carries that prefix; one device-side copy then spreads the packed rows
into `block_tables[:B, :width]`, whose row stride the graphs were captured with. A step's
copies grow with its batch and its longest sequence, not with `max_model_len`: copying every
row's W columns cost 2 MB a step at batch 64 and a 131,072-token `max_model_len`, 8 MB at
256 (issue 48). Columns past width and rows past B keep an older step's blocks: never read,
as a row reads only the blocks of its `seq_lens` (0 for padding rows).

Two mirrors alternate, each with the event of its last copy: the host may fill step N+1's
while step N's copy is still queued (the engine does not overlap steps yet, so the wait on
that event finds it done). Off CUDA the mirrors are ordinary memory and the copy a memcpy,
which the tests use.
"""

from __future__ import annotations

import numpy as np
import torch

_SMALL = (("input_ids", np.int64), ("positions", np.int64), ("slots", np.int64))


class GraphInputs:
    """The static input tensors of the decode graphs (`input_ids`, `positions`, `slots`,
    `seq_lens`, `block_tables`: views of one device buffer) and the step's `fill`."""

    def __init__(self, max_size: int, max_blocks: int, device: torch.device) -> None:
        n, self.max_size, self.max_blocks = max_size, max_size, max_blocks
        self.packed_offset = -(-(3 * 8 * n + 4 * n) // 8) * 8
        self.mirror_bytes = self.packed_offset + 4 * n * max_blocks
        self.nbytes = self.mirror_bytes + 4 * n * max_blocks  # and the graphs' table
        self.device = device
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.input_ids, self.positions, self.slots, self.seq_lens, _ = self._views(self.buffer)
        self.block_tables = (
            self.buffer[self.mirror_bytes :].view(torch.int32).view(n, self.max_blocks)
        )
        pinned = device.type == "cuda"
        self._mirrors = [
            torch.zeros(self.mirror_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)
        ]
        for buffer in (self.buffer, *self._mirrors):  # rows never filled write nothing
            self._views(buffer)[2].fill_(-1)
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self.copied_bytes = 0  # the last step's copies, host to device and on the device

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = self.max_size
        ids, positions, slots = (
            buffer[i * 8 * n : (i + 1) * 8 * n].view(torch.int64) for i in range(3)
        )
        seq_lens = buffer[24 * n : 28 * n].view(torch.int32)
        packed = buffer[self.packed_offset : self.mirror_bytes].view(torch.int32)
        return ids, positions, slots, seq_lens, packed

    def fill(
        self,
        size: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> None:
        """Write a step of B decodes (B <= `size`) padded to `size` rows into a mirror and
        queue its two copies into the buffer (padding rows: token 0 at position 0, slot -1,
        which the KV write skips, and length 0, which attends to nothing).

        Raises:
            ValueError: B past `size`, `size` past the largest batch, or a table too wide.
        """
        b, width = block_tables.shape
        if not b <= size <= self.max_size or width > self.max_blocks:
            raise ValueError(
                f"{b} decodes padded to {size} rows with {width} blocks each do not fit the "
                f"graphs' inputs ({self.max_size} rows of {self.max_blocks} blocks)"
            )
        index = self._next
        self._next ^= 1
        event = self._events[index]
        if event is not None:
            event.synchronize()  # the mirror's last copy has run (no overwrite mid-copy)
        mirror = self._mirrors[index]
        ids, pos, slot, lens, packed = (v.numpy() for v in self._views(mirror))
        ids[:b], ids[b:size] = input_ids, 0
        pos[:b], pos[b:size] = positions, 0
        slot[:b], slot[b:size] = slots, -1
        lens[:b], lens[b:size] = seq_lens, 0
        cells = b * width
        packed[:cells] = block_tables.reshape(-1)
        used = self.packed_offset + 4 * cells
        self.buffer[:used].copy_(mirror[:used], non_blocking=True)
        rows = self._views(self.buffer)[4][:cells].view(b, width)
        self.block_tables[:b, :width].copy_(rows, non_blocking=True)  # same stream: in order
        self.copied_bytes = used + 4 * cells
        if self.device.type == "cuda":
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            self._events[index] = done
