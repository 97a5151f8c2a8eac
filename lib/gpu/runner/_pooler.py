"""Pooling requests on the device: their prompt's hidden states become one float32 block.

A pooling request (embeddings, scores) is a prefill that samples nothing. Its prompt may
run over several steps (chunked prefill), so each request keeps what its pooling type needs
between steps: nothing for LAST (the last chunk holds the last token), a running sum for
MEAN, the first position's state for CLS, every chunk for ALL. The step its prompt ends,
its result joins the step's one contiguous block (`RunnerOutput.pooled`), float32 whatever
the model's dtype, so the frontend normalises at full precision. The block stays on the
device: the runner reads it to the host with the step's sampled tokens, in its one sync
(a read here would be a second sync of the step on CUDA).

The hidden states are the model's final ones (after its last norm, before the head: what
transformers' `AutoModel` returns as `last_hidden_state`). The runner forgets a request's
accumulator with its row (finished, aborted or preempted; a preempted one starts over).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...common.wire import PoolingType
from ._input_batch import StepInputs


@dataclass(slots=True)
class _Pool:
    """One request's pooling state between its prompt's chunks."""

    kind: PoolingType
    num_prompt_tokens: int
    total: torch.Tensor | None = None  # MEAN: the sum so far; CLS: position 0's state
    chunks: list[torch.Tensor] = field(default_factory=list)  # ALL: every chunk so far


class Pooler:
    """The pooling requests the runner holds, by request number."""

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}

    def __bool__(self) -> bool:
        return bool(self._pools)

    def add(self, rnum: int, kind: int, num_prompt_tokens: int) -> None:
        """Hold request `rnum` (new, or again after a preemption: it starts over)."""
        self._pools[rnum] = _Pool(PoolingType(kind), num_prompt_tokens)

    def remove(self, rnum: int) -> None:
        self._pools.pop(rnum, None)

    def pool(
        self, rnums: list[int], inputs: StepInputs, hidden: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray | None, torch.Tensor | None]:
        """Take this step's chunks of the pooling rows among `rnums` (the step's scheduled
        requests, in order).

        Returns:
            A bool per scheduled row (True: a pooling row, which must not sample), then the
            rnum of each pooled row and the float32 block [rows, hidden] of the requests
            whose prompt ended this step, on `hidden`'s device, not yet read (None, None if
            none did).
        """
        is_pooling = np.zeros(len(rnums), bool)
        done_rnums: list[int] = []
        results: list[torch.Tensor] = []
        for i, rnum in enumerate(rnums):
            pool = self._pools.get(rnum)
            if pool is None:
                continue
            is_pooling[i] = True
            start, count = int(inputs.token_starts[i]), int(inputs.counts[i])
            first_position = int(inputs.context_lens[i]) - count
            chunk = hidden[start : start + count]
            if not inputs.samples[i]:  # a chunk before the prompt's end: keep what it adds
                _fold(pool, chunk, first_position)
                continue
            result = _result(pool, chunk, first_position)
            done_rnums.extend([rnum] * int(result.shape[0]))
            results.append(result.to(torch.float32))
            del self._pools[rnum]
        if not results:
            return is_pooling, None, None
        return is_pooling, np.asarray(done_rnums, np.uint64), torch.cat(results)


def _fold(pool: _Pool, chunk: torch.Tensor, first_position: int) -> None:
    """Keep what `chunk` (hidden states [n, hidden] from `first_position` on) adds."""
    if pool.kind is PoolingType.MEAN:
        part = chunk.to(torch.float32).sum(0, keepdim=True)
        pool.total = part if pool.total is None else pool.total + part
    elif pool.kind is PoolingType.CLS:
        if first_position == 0:
            pool.total = chunk[:1].to(torch.float32)
    elif pool.kind is PoolingType.ALL:
        pool.chunks.append(chunk.to(torch.float32))


def _result(pool: _Pool, chunk: torch.Tensor, first_position: int) -> torch.Tensor:
    """The request's rows [n, hidden] given its prompt's last chunk."""
    if pool.kind is PoolingType.LAST:
        return chunk[-1:]
    _fold(pool, chunk, first_position)
    if pool.kind is PoolingType.MEAN:
        assert pool.total is not None
        return pool.total / pool.num_prompt_tokens
    if pool.kind is PoolingType.CLS:
        if pool.total is None:  # the scheduler never lets CLS start past position 0
            raise RuntimeError("a CLS pooling request started after its first position")
        return pool.total
    return torch.cat(pool.chunks)
