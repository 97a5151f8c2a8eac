"""The runner's requests: rows given and taken back as the scheduler adds and finishes them.

Apart from the step (`_model_runner`) because it is bookkeeping the step only reads: each new
request gets a persistent row (`InputBatch`), its sampling state and options by row (or a
pooling slot: embeddings sample nothing), its prompt embeddings and its adapter's slot; a
finished one gives them all back. `RequestRows` is that part of `ModelRunner`.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ...common.wire import LoraModule
from .._step_batch import StepBatch
from ..layers._parallel import TensorParallel
from ..lora._lora import LoraManager
from ..lora._lora_files import LoraAdapterError
from ..sample._sampling_rows import SamplingRows
from ..sample._sampling_state import RequestSamplingState
from ..spec_decode._draft_model import DraftModel
from ._input_batch import InputBatch
from ._pooler import Pooler
from ._prompt_embeds import PromptEmbeds


class RequestRows:
    """`ModelRunner`'s request bookkeeping and adapters, over the state its `__init__` sets
    (declared here)."""

    tp: TensorParallel
    device: torch.device
    inputs: InputBatch
    sampling: dict[int, RequestSamplingState]
    sampling_rows: SamplingRows
    _owe_prompt_logprobs: set[int]
    pooler: Pooler
    prompt_embeds: PromptEmbeds
    lora: LoraManager | None
    _lora_fallback_logged: bool
    drafter: DraftModel | None

    def add_lora(self, module: LoraModule) -> str:
        """Know adapter `module` (read and checked now); return its digest.

        Raises:
            LoraAdapterError: it cannot be served, or LoRA is off (`--enable-lora`).
        """
        if self.lora is None:
            raise LoraAdapterError(
                f"LoRA adapter {module.name!r}: LoRA is off: start the server with --enable-lora"
            )
        return self.lora.add(module)

    def remove_lora(self, lora_id: int) -> None:
        """Forget adapter `lora_id` for new requests (running ones keep it)."""
        if self.lora is not None:
            self.lora.remove(lora_id)

    def _log_lora_fallback(self) -> None:
        if self._lora_fallback_logged:
            return
        self._lora_fallback_logged = True
        if self.tp.rank == 0:
            print(
                "trillm worker: steps with LoRA adapters run the eager forward, not CUDA graphs "
                "(the deltas are added by the torch linears; base-only steps still use them)",
                file=sys.stderr,
                flush=True,
            )

    def remove_requests(self, rnums: np.ndarray) -> None:
        """Forget the requests `rnums` (their rows and sampling state); unknown ones too."""
        for rnum in rnums.tolist():
            if (row := self.inputs.row_of.get(rnum)) is not None:
                self.sampling_rows.remove(row)
                if self.lora is not None:
                    self.lora.remove_row(row)
            self.inputs.remove(rnum)
            self.sampling.pop(rnum, None)
            self._owe_prompt_logprobs.discard(rnum)
            self.pooler.remove(rnum)
            self.prompt_embeds.remove(rnum)

    def _update_requests(self, batch: StepBatch) -> None:
        self.remove_requests(batch.finished_rnums)
        for request in batch.new_requests:
            if (old := self.inputs.row_of.get(request.rnum)) is not None:
                self.sampling_rows.remove(old)
                if self.lora is not None:
                    self.lora.remove_row(old)
            row = self.inputs.add(request)
            if self.drafter is not None:
                self.drafter.forget_rows([row])
            if self.lora is not None:
                self.lora.add_row(row, request.lora_id)
            if request.prompt_embeds:
                self.prompt_embeds.add(request.rnum, request.prompt_embeds)
            if request.options.is_pooling:
                self.pooler.add(
                    request.rnum, request.options.pooling, len(request.prompt_token_ids)
                )
                continue
            state = RequestSamplingState(
                request.options, np.asarray(request.prompt_token_ids, np.int32), self.device
            )
            state.output_token_ids.extend(request.output_token_ids)
            self.sampling[request.rnum] = state
            self.sampling_rows.add(row, state)
            if request.options.prompt_logprobs is not None:
                self._owe_prompt_logprobs.add(request.rnum)
        if not len(batch.cached_rnums):
            return
        rows = self.inputs.rows_of(batch.cached_rnums)
        self.inputs.num_computed[rows] = batch.cached_num_computed
        if any(batch.cached_new_block_ids):  # most decode steps: none
            for row, blocks in zip(rows.tolist(), batch.cached_new_block_ids, strict=True):
                if blocks:
                    self.inputs.append_blocks(row, blocks)
