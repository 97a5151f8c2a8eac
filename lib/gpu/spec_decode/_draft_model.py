"""A draft model's proposals: a smaller model with the target's tokenizer, run by the same
runner over its own KV cache.

The draft's KV cache has the target's number of blocks and block size and is addressed by
the target's block tables: a request's blocks hold both models' K/V, each in its own
tensors, so the scheduler allocates (and the prefix cache frees) one set of block ids. The
scheduler reserves k slots past each running request's step (`lookahead`), where the draft
writes the K/V of the drafts it feeds back.

Proposing, after the target sampled: per row, one forward over the tokens whose draft K/V
is missing (`_computed[row]` up to the row's last token: the prompt at first, then the
tokens the last step accepted and the one it sampled), whose last logits give the first
draft (argmax); then k - 1 one-token steps give the rest. Drafts are greedy, so q is a
point mass and the target's verification (`_rejection`) keeps its distribution for every
request, seeded ones included. The K/V of drafts past the first are recomputed next time:
what the target rejected must not be read, and a catch-up of k + 1 tokens costs about one
decode step at these sizes.

Prefix-cache hits hold the target's K/V but maybe not the draft's (a block cached while
speculation was off), so a row given to a request starts with nothing computed for the
draft (`forget_rows`): its first catch-up is the whole prompt and what it generated. A
wrong draft K/V could only lower acceptance, never change the output: the target verifies
every draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ...common.config import WorkerConfig
from ..layers._parallel import TensorParallel
from ..loader._weights import open_model
from ..runner._forward import choose_path
from ..runner._input_batch import InputBatch, StepInputs
from ..worker._startup_log import StartupLog

if TYPE_CHECKING:
    from ..cpu._cpu_decode import CpuStep
    from ..loader._weights import Weights
    from ..models._model_config import ModelConfig
    from ..models.llama import LlamaForCausalLM
    from ..runner._forward import Path


class DraftRunner(Protocol):
    """What a draft model needs of the runner that runs it: a `ModelRunner` of the draft
    (`make_runner`, given by the target's runner, so this module does not import it)."""

    inputs: InputBatch
    cpu_step: CpuStep | None
    model: LlamaForCausalLM | None

    def load_model(self, weights: Weights | None, log: StartupLog | None = None) -> None: ...
    def kv_bytes_per_block(self) -> int: ...
    def init_kv_cache(self, num_blocks: int) -> None: ...
    def free_kv_cache(self) -> int: ...
    def hidden_states(self, path: Path, inputs: StepInputs, embeds: None) -> torch.Tensor: ...


MakeRunner = Callable[["WorkerConfig", "ModelConfig", TensorParallel, torch.device], DraftRunner]


class DraftModel:
    """The draft runner (a `ModelRunner` of the draft model that reads the target's rows)
    and, per row, how many of its tokens have draft K/V."""

    def __init__(self, runner: DraftRunner, inputs: InputBatch) -> None:
        self.runner = runner
        runner.inputs = inputs  # the target's rows: tokens, block tables
        self.inputs = inputs
        self._computed = np.zeros(len(inputs.num_tokens), np.int64)

    @classmethod
    def load(
        cls,
        config: WorkerConfig,
        model: str,
        tp: TensorParallel,
        device: torch.device,
        inputs: InputBatch,
        vocab_size: int,
        log: StartupLog | None = None,
        *,
        make_runner: MakeRunner,
    ) -> DraftModel:
        """Load the draft model at `model` for a target of `config`, run by a runner
        `make_runner` builds (the target's own class).

        Raises:
            ValueError: its vocabulary is not the target's.
        """
        model_config, weights = open_model(model, "auto")
        if model_config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model {model!r} has a vocabulary of {model_config.vocab_size} "
                f"tokens, the target {vocab_size}: give a draft model with the target's "
                f"tokenizer"
            )
        draft_config = dataclasses.replace(
            config, model=model, load_format="auto", speculative_config=None
        )
        if getattr(draft_config, "enable_lora", False):  # the draft runs no adapter
            object.__setattr__(draft_config, "enable_lora", False)
        runner = make_runner(draft_config, model_config, tp, device)
        runner.load_model(weights, log)
        return cls(runner, inputs)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)
        self._computed[:] = 0

    def free_kv_cache(self) -> None:
        self.runner.free_kv_cache()
        self._computed[:] = 0

    @torch.inference_mode()
    def propose(
        self, inputs: InputBatch, rows: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Up to k greedy drafts per row of `rows` (offsets int32 [rows + 1], tokens int32),
        within the blocks each row holds."""
        ends = inputs.num_tokens[rows].astype(np.int64)
        room = inputs.num_blocks[rows].astype(np.int64) * inputs.block_size - ends + 1
        room = np.minimum(np.minimum(room, k), inputs.max_model_len - ends)
        active = room > 0
        rows, ends, room = rows[active], ends[active], room[active]
        drafts = np.zeros((len(rows), k), np.int32)
        if len(rows):
            starts = np.minimum(self._computed[rows], ends - 1)
            token = self._step(rows, starts, ends)
            self._computed[rows] = ends
            for j in range(k):
                drafts[:, j] = token
                if j + 1 == k or not (room > j + 1).any():
                    break
                inputs.token_ids[rows, ends + j] = token
                token = self._step(rows, ends + j, ends + j + 1)
        counts = np.zeros(len(active), np.int64)
        counts[active] = room
        offsets = np.zeros(len(active) + 1, np.int32)
        np.cumsum(counts, out=offsets[1:])
        tokens = (
            np.concatenate([drafts[i, :n] for i, n in enumerate(room.tolist())])
            if len(rows)
            else np.zeros(0, np.int32)
        )
        return offsets, tokens.astype(np.int32, copy=False)

    def forget_rows(self, rows: list[int]) -> None:
        """Rows the runner gave to a request (new, or again after a preemption) hold no
        draft K/V of it yet."""
        self._computed[rows] = 0

    def _step(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """One draft forward over tokens [starts, ends) of each row; the argmax after each
        row's last token."""
        runner = self.runner
        step = _flat_inputs(self.inputs, rows, starts, ends)
        path = choose_path(step, None, runner.cpu_step)
        hidden = runner.hidden_states(path, step, None)
        last = torch.from_numpy(step.token_starts + step.counts - 1)
        head = runner.cpu_step or runner.model
        assert head is not None
        logits = head.compute_logits(hidden[last])
        return logits.argmax(dim=-1).to(torch.int32).numpy()


def _flat_inputs(
    inputs: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> StepInputs:
    """A step's flattened inputs over tokens [starts, ends) of each row (`InputBatch.prepare`
    for positions the draft, not the scheduler, chose)."""
    counts = (ends - starts).astype(np.int64)
    offsets = np.cumsum(counts) - counts
    token_row = np.repeat(np.arange(len(rows)), counts)
    positions = starts[token_row] + np.arange(int(counts.sum())) - offsets[token_row]
    req_rows = rows[token_row]
    size = inputs.block_size
    blocks = inputs.block_table[req_rows, positions // size].astype(np.int64)
    return StepInputs(
        rows=rows.astype(np.int64),
        counts=counts,
        token_starts=offsets,
        input_ids=inputs.token_ids[req_rows, positions].astype(np.int64),
        positions=positions,
        slots=blocks * size + positions % size,
        context_lens=ends.astype(np.int64),
        samples=np.ones(len(rows), bool),
    )
