"""A step's output read later (async scheduling): the pending output and the input-id patch.

With `--async-scheduling` the engine runs step N+1 before it reads N's tokens. The runner
then counts each sampling row's token as appended at once (a placeholder in `InputBatch`),
queues the copy of N's results to the host (pinned memory and an event on CUDA) and returns
a `PendingOutput`; N+1's rows whose input is such a placeholder get their id from N's
sampled-token tensor where it lies, by one `index_copy_` into the step's ids (on CUDA after
the host ids' copy, in the same stream, so the stream orders them). `result()` waits for the
copy, writes the tokens into the rows that still hold the same request, and returns N's
`RunnerOutput`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .._step_batch import RunnerOutput


class PendingOutput(Protocol):
    """A step's output, maybe still being computed."""

    def result(self) -> RunnerOutput:
        """Wait for the step's results on the host; the same object at every call."""
        ...


@dataclass(frozen=True, slots=True)
class ReadyOutput:
    """An output known when the step returned (synchronous steps, the null executor)."""

    output: RunnerOutput

    def result(self) -> RunnerOutput:
        return self.output


@dataclass(frozen=True, slots=True)
class WithFailures:
    """A step's output whose requests `failed` (rnum -> why: their LoRA adapter could not be
    read) are ended with that error by the engine; their tokens are dropped."""

    pending: PendingOutput
    failed: dict[int, str]

    def result(self) -> RunnerOutput:
        output = self.pending.result()
        output.failed = self.failed
        return output


class HostCopy:
    """Device tensors on their way to the host: on CUDA non-blocking copies into pinned
    memory and an event, waited for at `wait`; on the CPU the tensors themselves."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self._event: torch.cuda.Event | None = None
        if not any(t is not None and t.is_cuda for t in tensors):
            self._hosts = list(tensors)
            return
        self._hosts = [
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            for t in tensors
        ]
        for host, tensor in zip(self._hosts, tensors, strict=True):
            if host is not None and tensor is not None:
                host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record()

    def wait(self) -> list[np.ndarray | None]:
        if self._event is not None:
            self._event.synchronize()
        return [None if h is None else h.numpy() for h in self._hosts]


@dataclass(frozen=True, slots=True)
class AheadTokens:
    """A step's sampled tokens not yet on the host: the rows (and each row's generation,
    `InputBatch.generation`, so a row given to another request is told apart), the
    placeholder's position in each row, and the tokens where the sampler left them."""

    rows: np.ndarray  # [n] int64
    generations: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    tokens: torch.Tensor  # [n] int32, on the device


@dataclass(frozen=True, slots=True)
class IdsPatch:
    """Which of a step's flattened input ids come from a step in flight, and from where."""

    dst: np.ndarray  # [m] int64 index into the step's input ids
    src: np.ndarray  # [m] int64 index into `AheadTokens.tokens`
    tokens: torch.Tensor

    def apply(self, ids: torch.Tensor, to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        """Copy the tokens into `ids` (on `ids`' device; queued in its stream on CUDA)."""
        values = self.tokens.index_select(0, to_device(self.src)).to(ids.dtype)
        ids.index_copy_(0, to_device(self.dst), values)


def ids_patch(
    ahead: AheadTokens,
    generation: np.ndarray,
    rows: np.ndarray,
    counts: np.ndarray,
    token_starts: np.ndarray,
    positions: np.ndarray,
) -> IdsPatch | None:
    """The patch of a step (`StepInputs`' columns) whose rows may read `ahead`'s
    placeholders: each row still held by the same request (same generation) and whose
    scheduled positions cover its placeholder. None: no row does."""
    live = generation[ahead.rows] == ahead.generations
    index = np.full(len(generation), -1, np.int64)
    index[ahead.rows[live]] = np.flatnonzero(live)
    src = index[rows]
    has = np.flatnonzero(src >= 0)
    if not len(has):
        return None
    src = src[has]
    offset = ahead.positions[src] - positions[token_starts[has]]
    covered = (offset >= 0) & (offset < counts[has])
    if not covered.any():
        return None
    dst = token_starts[has][covered] + offset[covered]
    return IdsPatch(dst.astype(np.int64), src[covered].astype(np.int64), ahead.tokens)
