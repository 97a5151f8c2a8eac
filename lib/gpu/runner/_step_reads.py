"""The host read-back of one step: what it reads besides the sampled tokens, and how.

A step's results leave the device once: on CUDA, non-blocking copies into pinned memory and
one wait for the stream, the decode step's only sync (`to_host`). Prompt logprobs (echo) and
pooled rows are computed on the device as the step goes (`StepReads`) and read in that same
copy; a step ahead (async scheduling) is read later, when the engine asks (`AheadOutput`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .._step_batch import PromptLogprobs, RunnerOutput, StepBatch
from ..sample._sampler import compute_logprobs
from ._ahead import AheadTokens, HostCopy

if TYPE_CHECKING:
    from ..models.llama import LlamaForCausalLM
    from ..sample._sampling_state import RequestSamplingState
    from ._input_batch import InputBatch, StepInputs


class PendingPromptLogprobs(NamedTuple):
    """One request's prompt logprobs of a step, before they are read to the host."""

    rnum: int
    first_position: int
    tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass(slots=True)
class StepReads:
    """A step's device results besides the sampled tokens: read to the host with them, in
    the step's one sync on CUDA (`to_host`), then set on its output."""

    prompt_logprobs: list[PendingPromptLogprobs]
    pooled_rnums: np.ndarray | None = None
    pooled: torch.Tensor | None = None  # float32 [rows, hidden], `Pooler.pool`'s block

    def tensors(self) -> list[torch.Tensor | None]:
        """What to read, in order: three per pending prompt logprobs, then the pooled block."""
        return [*(t for p in self.prompt_logprobs for t in p.tensors), self.pooled]

    def apply(self, output: RunnerOutput, hosted: list[np.ndarray | None]) -> None:
        """Set `output`'s prompt logprobs and pooled rows from `tensors()` read (`hosted`)."""
        for i, p in enumerate(self.prompt_logprobs):
            logprobs, topk_ids, topk_logprobs = hosted[3 * i : 3 * i + 3]
            assert logprobs is not None
            output.prompt_logprobs[p.rnum] = PromptLogprobs(
                p.first_position, logprobs, topk_ids, topk_logprobs
            )
        output.pooled_rnums, output.pooled = self.pooled_rnums, hosted[-1]


def prompt_logprobs(
    batch: StepBatch,
    inputs: StepInputs,
    hidden: torch.Tensor,
    *,
    owed: set[int],
    sampling: dict[int, RequestSamplingState],
    rows: InputBatch,
    model: LlamaForCausalLM,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> list[PendingPromptLogprobs]:
    """Logprobs of the prompt tokens this step covers, for requests that asked (echo),
    still on the device (read with the sampled tokens). Python only over the requests
    that owe some (`owed`, which loses each as its last prompt position is scored): none in
    most steps."""
    if not owed:
        return []
    scheduled = batch.scheduled_rnums
    asked = np.isin(scheduled, np.fromiter(owed, np.uint64, len(owed)))
    result: list[PendingPromptLogprobs] = []
    for i in np.flatnonzero(asked).tolist():
        rnum = int(scheduled[i])
        k = sampling[rnum].options.prompt_logprobs
        assert k is not None  # owed only by requests that asked
        row = int(inputs.rows[i])
        prompt_len = int(rows.num_prompt_tokens[row])
        start = int(inputs.context_lens[i] - inputs.counts[i])
        end = min(int(inputs.context_lens[i]), prompt_len - 1)  # positions that score p+1
        if end >= prompt_len - 1:
            owed.discard(rnum)  # its last prompt position is scored now (or was)
        if start >= end:
            continue
        first = int(inputs.token_starts[i])
        logits = model.compute_logits(hidden[first : first + end - start])
        targets = to_device(rows.token_ids[row, start + 1 : end + 1].astype(np.int64))
        tensors = compute_logprobs(logits, targets, k)
        result.append(PendingPromptLogprobs(rnum, start + 1, tensors))
    return result


class AheadOutput:
    """A step ahead's output (`ModelRunner.execute_ahead`): `result()` reads it, and
    `resolve` appends its tokens to the rows still holding them."""

    def __init__(
        self,
        resolve: Callable[[AheadTokens, np.ndarray], None],
        ahead: AheadTokens,
        rnums: np.ndarray,
        copy: HostCopy,
        reads: StepReads,
    ) -> None:
        self._resolve, self._ahead, self._rnums = resolve, ahead, rnums
        self._copy, self._reads = copy, reads
        self._output: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._output is None:
            token_ids, logprobs, topk_ids, topk_logprobs, *rest = self._copy.wait()
            assert token_ids is not None
            self._resolve(self._ahead, token_ids)
            output = RunnerOutput(
                self._rnums,
                token_ids,
                logprobs=logprobs,
                topk_ids=topk_ids,
                topk_logprobs=topk_logprobs,
            )
            self._reads.apply(output, rest)
            self._output = output
        return self._output


def _numpy(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else tensor.cpu().numpy()


def to_host(*tensors: torch.Tensor | None) -> list[np.ndarray | None]:
    """The step's results as numpy: on CUDA, non-blocking copies into pinned memory and one
    wait for the stream, the decode step's only sync."""
    if not any(t is not None and t.is_cuda for t in tensors):
        return [_numpy(t) for t in tensors]
    hosts = [
        None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors
    ]
    for host, tensor in zip(hosts, tensors, strict=True):
        if host is not None and tensor is not None:
            host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return [None if h is None else h.numpy() for h in hosts]
