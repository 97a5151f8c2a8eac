"""LoRA deltas of one step, over fixed device slots (Punica's shrink/expand, grouped by slot).

Every adapted linear keeps two buffers with one slot per resident adapter (`--max-loras`),
allocated once at start-up, so loading an adapter is a copy into a free slot and no step
allocates:

    a [slots, parts * R, in_local]    (shrink: each part's A, stacked)
    b [slots, out_local, parts * R]   (expand: each part's B, block-diagonal)

R is `--max-lora-rank` (a smaller rank is zero-padded); `parts` are the merged projections
of the base layer (q, k, v; gate, up), so a merged linear still takes one shrink and one
expand per adapter. Tensor parallel as vLLM: a column-parallel layer keeps its rank's rows of
B (A whole), a row-parallel one its rank's columns of A (B whole): its partial deltas are
added before the all-reduce the base layer already does.

The step's rows are grouped by slot once, by the runner (`LoraBatch.set`): each group is the
token indexes of one adapter (a slice when they are contiguous). A linear then runs, after
its base product, one low-rank matmul pair per active adapter, `out[idx] += (x[idx] @ a.T)
@ b.T`; base rows (slot -1) cost nothing.

On the CPU the C decode step adds the same deltas inside its own products (`csrc/tl_lora.h`),
per token by its slot (`LoraBatch.token_slots`). It reads `a` as it is and B in its tiles'
layout, kept beside `b` by `set_slot`:

    bt [slots, tiles, R, 16]          (16 output rows side by side, each row's own part's R
                                       columns of b: the block-diagonal's zeros left out)

and `ranks` [slots] (int32), the rank each slot's adapter has in this linear (0: none).
"""

from __future__ import annotations

import numpy as np
import torch

Group = tuple[int, torch.Tensor | slice]


class LoraBatch:
    """The step's token groups by slot; one object shared by every adapted linear (set by
    the runner before each forward, empty when no row of the step has an adapter)."""

    def __init__(self) -> None:
        self.groups: list[Group] = []
        self.token_slots: np.ndarray | None = None  # int32 per token, for the C step

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """Group the step's tokens by slot (-1: the base model, no delta)."""
        self.token_slots = np.ascontiguousarray(token_slots, np.int32)
        groups: list[Group] = []
        for slot in np.unique(token_slots).tolist():
            if slot < 0:
                continue
            where = np.flatnonzero(token_slots == slot)
            first, last = int(where[0]), int(where[-1])
            if last - first + 1 == len(where):
                groups.append((slot, slice(first, last + 1)))
            else:
                groups.append((slot, torch.from_numpy(where).to(device)))
        self.groups = groups

    def clear(self) -> None:
        self.groups = []
        self.token_slots = None


class LoraLinear:
    """The slot buffers of one base linear and its delta (`add_delta`).

    `parts`: the local output rows of each merged part (one part for a row-parallel layer);
    `shard`: for a column-parallel layer, (rank, shard rows) per part to narrow B; for a
    row-parallel one, (rank, local in-features) to narrow A.
    """

    def __init__(
        self,
        *,
        column: bool,
        parts: list[int],
        in_local: int,
        num_slots: int,
        max_rank: int,
        tp_rank: int,
        batch: LoraBatch,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.column = column
        self.parts = parts
        self.in_local = in_local
        self.max_rank = max_rank
        self.tp_rank = tp_rank
        self.batch = batch
        width, out = len(parts) * max_rank, sum(parts)
        self.a = torch.zeros(num_slots, width, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out, width, dtype=dtype, device=device)
        self.bt: torch.Tensor | None = None  # the C step's B (CPU only)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32)
        if device.type == "cpu":
            tiles = -(-out // 16)
            self.bt = torch.zeros(num_slots, tiles, max_rank, 16, dtype=dtype)
            part = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(parts))
            # row n's columns of b in bt: its part's R
            self._bt_columns = part[:, None] * max_rank + torch.arange(max_rank)

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Copy an adapter's (A [r, in], B [out, r]) of each part (None: not adapted) into
        `slot`, this rank's shard of them; the rest of the slot is zeroed."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = max((w[0].shape[0] for w in weights if w is not None), default=0)
        rows = 0
        for p, (size, pair) in enumerate(zip(self.parts, weights, strict=True)):
            if pair is not None:
                a, b = pair
                r, col = a.shape[0], p * self.max_rank
                if self.column:
                    b = b.narrow(0, self.tp_rank * size, size)
                else:
                    a = a.narrow(1, self.tp_rank * self.in_local, self.in_local)
                self.a[slot, col : col + r].copy_(a)
                self.b[slot, rows : rows + size, col : col + r].copy_(b)
            rows += size
        if self.bt is not None:
            tiles, rank = self.bt.shape[1], self.max_rank
            compact = torch.zeros(tiles * 16, rank, dtype=self.bt.dtype)
            compact[:rows] = self.b[slot].gather(1, self._bt_columns)
            self.bt[slot].copy_(compact.view(tiles, 16, rank).transpose(1, 2))

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus each row's adapter delta (in place; base rows unchanged)."""
        for slot, rows in self.batch.groups:
            a, b = self.a[slot], self.b[slot]
            if isinstance(rows, slice):
                out[rows] += torch.mm(torch.mm(x[rows], a.t()), b.t())
            else:
                out.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a.t()), b.t()))
        return out
