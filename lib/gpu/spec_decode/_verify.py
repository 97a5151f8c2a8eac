"""A speculative step in the runner: its drafts verified after the forward, the next proposed.

Apart from the step (`runner/_model_runner`) because only speculative decoding needs it:
verifying samples every position of the rows with drafts and keeps what they accept
(`_speculator`, `_rejection`), rolling back the KV of what was rejected; proposing asks the
draft model, or looks the row's suffix up in its own tokens (`_ngram`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...common.speculative import SpeculativeConfig
from .._step_batch import RunnerOutput, StepBatch
from ..runner._input_batch import InputBatch, StepInputs
from ..runner._step_reads import StepReads, to_host
from ..sample._grammar_mask import apply_grammar_bitmask, step_bitmask
from ..sample._sampler import Sampler
from ..sample._sampling_batch import SamplingBatch
from ..sample._sampling_rows import SamplingRows
from ..sample._sampling_state import RequestSamplingState
from ._ngram import propose_rows
from ._speculator import StepDrafts

if TYPE_CHECKING:
    from ..cpu._cpu_decode import CpuStep
    from ..models.llama import LlamaForCausalLM
    from ._draft_model import DraftModel


def verify(
    batch: StepBatch,
    masks: Callable[[], np.ndarray] | None,
    drafts: StepDrafts,
    inputs: StepInputs,
    hidden: torch.Tensor,
    sampling: np.ndarray,
    states: list[RequestSamplingState],
    reads: StepReads,
    *,
    head: CpuStep | LlamaForCausalLM,
    sampler: Sampler,
    rows_state: InputBatch,
    sampling_rows: SamplingRows,
    sampling_batch: Callable[[list[RequestSamplingState]], SamplingBatch],
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> RunnerOutput:
    """Sample every position of the rows with drafts and keep what they accept
    (`_speculator`); the others sample their one position as usual. `reads` are read
    with the sampled tokens; the accepted tokens are appended to `rows_state` and
    `sampling_rows`."""
    rnums = batch.scheduled_rnums[sampling]
    last = inputs.token_starts[sampling] + inputs.counts[sampling] - 1
    index = drafts.logit_index(sampling, last)
    logits = head.compute_logits(hidden[to_device(index)])
    positions = drafts.positions(sampling)
    if len(batch.grammar_rnums):
        per_rnum = dict(zip(rnums.tolist(), positions.tolist(), strict=True))
        grammar = batch.grammar_rnums
        grammar = np.repeat(grammar, [per_rnum[r] for r in grammar.tolist()])
        apply_grammar_bitmask(
            logits, np.repeat(rnums, positions), grammar, step_bitmask(batch, masks)
        )
    seeded = drafts.seeded_states(sampling, states)
    positioned = drafts.position_states(sampling, states)
    sampled = sampler(logits, sampling_batch(positioned))
    token_ids, logprobs, topk_ids, topk_logprobs, *rest = to_host(
        sampled.token_ids.to(torch.int32),
        sampled.logprobs,
        sampled.topk_ids,
        sampled.topk_logprobs,
        *reads.tensors(),
    )
    assert token_ids is not None
    accepted = drafts.accept(sampling, token_ids, seeded, int(logits.shape[1]))
    keep = accepted.token_index
    rows = inputs.rows[sampling]
    # The rejected drafts' KV is not computed: the scheduler rolls it back too.
    rows_state.num_computed[rows] -= positions - 1 - accepted.num_accepted
    tokens = token_ids[keep]
    rows_state.append_token_runs(rows, accepted.token_offsets, tokens)
    sampling_rows.append_runs(rows, accepted.token_offsets, tokens)
    output = RunnerOutput(
        rnums,
        tokens,
        logprobs=None if logprobs is None else logprobs[keep],
        topk_ids=None if topk_ids is None else topk_ids[keep],
        topk_logprobs=None if topk_logprobs is None else topk_logprobs[keep],
        token_offsets=accepted.token_offsets,
    )
    reads.apply(output, rest)
    return output


def propose(
    spec: SpeculativeConfig | None,
    drafter: DraftModel | None,
    rows_state: InputBatch,
    k: int,
    rows: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Each of `rows`' drafts for the next step (at most k; offsets and tokens)."""
    if spec is None:
        raise RuntimeError("a step asked for drafts, but speculative decoding is off")
    if drafter is not None:
        return drafter.propose(rows_state, rows, k)
    return propose_rows(
        rows_state.token_ids,
        rows_state.num_tokens,
        rows,
        k,
        min_n=spec.prompt_lookup_min,
        max_n=spec.prompt_lookup_max,
    )
