"""Prompts given as embeddings (vLLM's `prompt_embeds`): the rows that replace the token
embedding lookup at their prompt positions.

A request's embeddings arrive once, with its `NewRequest` (float32 little-endian bytes
[prompt tokens, hidden], checked by the frontend and the scheduler), and stay here until it
ends or is preempted: a chunked prompt takes the rows of each chunk's positions in turn.
Positions past the prompt (the generated tokens) use ordinary token embeddings, so only steps
that compute prompt positions of such a request carry any, and those run the torch forward
(`choose_path`'s "must run the torch forward"), never a decode graph or the C step, which
read token ids.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ._input_batch import StepInputs

Embeds = tuple[torch.Tensor, torch.Tensor]  # (indexes into the step's tokens, rows [n, hidden])


class PromptEmbeds:
    """The prompt embeddings of the requests that sent them, by request number."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self._rows: dict[int, np.ndarray] = {}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def add(self, rnum: int, data: bytes) -> None:
        """Keep `rnum`'s embeddings (float32 [prompt tokens, hidden] bytes)."""
        rows = np.frombuffer(data, "<f4").reshape(-1, self.hidden_size)
        self._rows[rnum] = rows

    def remove(self, rnum: int) -> None:
        self._rows.pop(rnum, None)

    def for_step(
        self, rnums: list[int], inputs: StepInputs, tensor: Callable[[np.ndarray], torch.Tensor]
    ) -> Embeds | None:
        """The rows this step's prompt positions take, and where they go among its tokens;
        None when no scheduled request computes a position of its embedded prompt."""
        indexes, rows = [], []
        for i, rnum in enumerate(rnums):
            embeds = self._rows.get(rnum)
            if embeds is None:
                continue
            start = int(inputs.context_lens[i] - inputs.counts[i])  # its first position
            end = min(int(inputs.context_lens[i]), len(embeds))
            if start >= end:
                continue  # past its prompt: generated tokens look their embeddings up
            first = int(inputs.token_starts[i])
            indexes.append(np.arange(first, first + end - start, dtype=np.int64))
            rows.append(embeds[start:end])
        if not rows:
            return None
        return tensor(np.concatenate(indexes)), tensor(np.concatenate(rows))
