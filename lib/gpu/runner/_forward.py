"""Which path a step's forward takes, decided in one place, and the fault hook before it.

What exists is fixed when the model is built: CUDA graphs (`DecodeGraphs`, on CUDA) and the
C step (`CpuStep`, on CPU). A step then takes, by its shape:

- `Path.GRAPH`: decodes only (one token per sequence), as many as a captured graph takes;
- `Path.C_STEP`: decodes only, as many as the C step's `max_batch` and of a size where it
  beat the torch forward on this machine (`CpuStep.covers`: the measured `DecodePaths`, or
  `--cpu-decode`), one C call; or a speculative verify step of few tokens, a row per token
  (`expand_verify_rows`), by the same table at its token count;
- `Path.C_ATTENTION`: any other step the C step attends (no prompt's context past
  `PROMPT_CONTEXT_MAX`): the torch forward with C's attention in each layer;
- `Path.EAGER`: the rest, the torch forward with the configured attention backend.

The `inject_fault` test hook (`WorkerConfig.fault_at`) arms the torch forward with an
`InjectedFault` (`FaultHook`: the model itself knows no hook), which `LlamaForCausalLM.forward`
raises; a step it arms takes neither a graph nor the C step, which would skip that forward.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from ...common.config import WorkerConfig
from ..worker._failure import InjectedFault

if TYPE_CHECKING:
    from ..cpu._cpu_decode import CpuStep
    from ..models.llama import LlamaForCausalLM
    from ._cuda_graphs import DecodeGraphs
    from ._input_batch import StepInputs


# A verify step (speculative decoding) of up to this many tokens runs the C step, a row per
# token, rather than the torch forward with oneDNN's linears: on the default model (float32,
# one thread, CPU time of a step; `perf/spec_bench.py --verify`, this 2-core machine at load
# ~6.7) the C step took 47 / 54 / 76 / 118 / 166 ms for 5 / 10 / 20 / 40 / 60 tokens and the
# oneDNN forward 70 / 82 / 104 / 141 / 182 ms (1.49x down to 1.10x): faster at every size it
# takes, so the bound is the C step's own (`CpuStep.covers`, its 64-row build, and the decode
# step's measured table at the verify step's token count, a row per token being a decode).
VERIFY_C_STEP_MAX = 64


def expand_verify_rows(
    counts: np.ndarray, positions: np.ndarray, table: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A step's sequences as one row per token, for the C step (which takes one token per
    row): each token's context (up to its own position) and its sequence's block table row."""
    return (positions + 1).astype(np.int64), np.repeat(table, counts, axis=0)


class Path(enum.Enum):
    """How one step's forward runs."""

    GRAPH = "graph"  # replay of a captured CUDA graph
    C_STEP = "c step"  # `CpuStep.run`: the whole forward in one C call
    C_ATTENTION = "c attention"  # the torch forward, C's attention (`CpuStep.attention`)
    EAGER = "eager"  # the torch forward, the attention backend's metadata


def choose_path(
    inputs: StepInputs,
    graphs: DecodeGraphs | None,
    cpu_step: CpuStep | None,
    *,
    fault: bool = False,
    verify: bool = False,
) -> Path:
    """The path of the step of `inputs`, given the graphs and the C step built (None: not
    built, or dropped by a sleep); `fault`: the step must run the torch forward; `verify`:
    the step's multi-token rows verify speculative drafts (a few tokens each)."""
    num_seqs = len(inputs.rows)
    num_tokens = len(inputs.input_ids)
    decodes = num_tokens == num_seqs  # one token each
    if graphs is not None and decodes and not fault and graphs.size_for(num_seqs) is not None:
        return Path.GRAPH
    if cpu_step is None or not cpu_step.attends(inputs.counts, inputs.context_lens):
        return Path.EAGER
    if decodes and not fault and cpu_step.covers(num_seqs):
        return Path.C_STEP
    if verify and not fault and num_tokens <= VERIFY_C_STEP_MAX and cpu_step.covers(num_tokens):
        return Path.C_STEP  # a row per token (`expand_verify_rows`)
    return Path.C_ATTENTION  # prompts, or more decodes than the C step takes


class FaultHook:
    """The `inject_fault` test hook of one rank: "forward:RANK:STEP" fails that rank's forward
    at step STEP (counted from 0, empty steps too), "token:RANK:ID" at every step that feeds
    token ID. Unset, it never fires."""

    def __init__(self, config: WorkerConfig, rank: int) -> None:
        kind, at_rank, at = config.fault_at() or ("", -1, -1)
        self.fault_step = at if at_rank == rank and kind == "forward" else -1
        self.fault_token = at if at_rank == rank and kind == "token" else -1
        self.num_steps = 0

    def arm(self, model: LlamaForCausalLM, inputs: StepInputs | None) -> bool:
        """Count a step and arm `model`'s next forward if this step is to fail; whether it is
        armed. `inputs` None: nothing was scheduled, so no forward runs and a fault due now
        stays armed for the next step's."""
        step, self.num_steps = self.num_steps, self.num_steps + 1
        if step == self.fault_step or (
            inputs is not None
            and self.fault_token >= 0
            and bool((inputs.input_ids == self.fault_token).any())
        ):
            model.fault = InjectedFault("injected fault in LlamaForCausalLM.forward (test hook)")
        return model.fault is not None
