"""The forward's path for a step (`choose_path`) and the fault hook before it, in isolation.

The graphs and the C step are stand-ins that answer only what the choice asks; the runner's
tests (test_cuda_graphs, test_cpu_decode) check each path's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from trillm.gpu import WorkerConfig
from trillm.gpu.runner._forward import FaultHook, Path, choose_path
from trillm.gpu.runner._input_batch import StepInputs


def _inputs(counts: list[int], context_lens: list[int] | None = None) -> StepInputs:
    n = int(sum(counts))
    contexts = np.array(context_lens or counts, np.int32)
    return StepInputs(
        rows=np.arange(len(counts), dtype=np.int32),
        counts=np.array(counts, np.int32),
        token_starts=np.cumsum([0, *counts[:-1]]).astype(np.int32),
        input_ids=np.arange(n, dtype=np.int64),
        positions=np.zeros(n, np.int64),
        slots=np.zeros(n, np.int64),
        context_lens=contexts,
        samples=np.ones(len(counts), bool),
    )


@dataclass
class _Graphs:
    max_size: int

    def size_for(self, num_seqs: int) -> int | None:
        return num_seqs if num_seqs <= self.max_size else None


@dataclass
class _CpuStep:
    max_batch: int
    prompt_context_max: int = 512
    bound: bool = True

    def attends(self, counts: np.ndarray, context_lens: np.ndarray) -> bool:
        prompts = counts > 1
        return self.bound and (
            not prompts.any() or int(context_lens[prompts].max()) <= self.prompt_context_max
        )

    def covers(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch


def _path(inputs: StepInputs, graphs: Any = None, cpu_step: Any = None, **kw: bool) -> Path:
    return choose_path(inputs, graphs, cpu_step, **kw)


def test_decodes_replay_a_graph_that_fits_else_run_eager() -> None:
    assert _path(_inputs([1] * 4), _Graphs(8)) is Path.GRAPH
    assert _path(_inputs([1] * 9), _Graphs(8)) is Path.EAGER
    assert _path(_inputs([1, 3]), _Graphs(8)) is Path.EAGER  # a prompt's chunk: no graph
    assert _path(_inputs([1] * 4)) is Path.EAGER


def test_the_c_step_runs_the_decodes_it_covers_and_attends_the_rest() -> None:
    assert _path(_inputs([1] * 8), cpu_step=_CpuStep(8)) is Path.C_STEP
    assert _path(_inputs([1] * 9), cpu_step=_CpuStep(8)) is Path.C_ATTENTION
    assert _path(_inputs([1, 5]), cpu_step=_CpuStep(8)) is Path.C_ATTENTION
    long_prompt = _inputs([1, 5], [9, 600])
    assert _path(long_prompt, cpu_step=_CpuStep(8)) is Path.EAGER
    assert _path(_inputs([1] * 2), cpu_step=_CpuStep(8, bound=False)) is Path.EAGER


def test_a_faulting_step_runs_the_torch_forward_where_the_hook_raises() -> None:
    assert _path(_inputs([1] * 4), _Graphs(8), fault=True) is Path.EAGER
    assert _path(_inputs([1] * 4), cpu_step=_CpuStep(8), fault=True) is Path.C_ATTENTION


class _Model:
    fault: Exception | None = None


@pytest.mark.parametrize(
    ("fault", "armed_at"),
    [
        (None, []),
        ("forward:0:1", [1]),
        ("forward:0:2", [3]),  # step 2 is empty: the fault waits for step 3's forward
        ("forward:1:2", []),  # another rank's
        ("token:0:7", [4]),  # the first step that feeds token 7
    ],
)
def test_the_fault_hook_arms_the_forward_of_its_step(
    fault: str | None, armed_at: list[int]
) -> None:
    hook = FaultHook(WorkerConfig("m", inject_fault=fault), rank=0)
    model = _Model()
    steps = [_inputs([1]), _inputs([1]), None, _inputs([1]), _inputs([8])]
    armed = []
    for i, inputs in enumerate(steps):
        if hook.arm(model, inputs) and inputs is not None:  # type: ignore[arg-type]
            armed.append(i)
            model.fault = None  # as the forward does when it raises
    assert armed == armed_at
