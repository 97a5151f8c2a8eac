"""The model runner: turns a `StepBatch` into one forward pass and sampled tokens.

Per step: forget finished requests, add new ones, append new blocks, flatten the scheduled
tokens (`InputBatch.prepare`, vectorised), arm the fault hook, run the forward over the mixed
batch by the one path `choose_path` picks (`_forward`: a CUDA-graph replay, the C step, C's
attention in the torch forward, or the torch forward with its attention metadata), compute
logits only for the rows that reach their sequence's end (and for prompt positions of `echo`
requests), sample, and append the sampled tokens to the persistent rows. Pooling requests
(embeddings) sample nothing: their rows go to the `Pooler`, which returns one float32 block.
A step runs Python per request only for the requests that need it: the sampling options
are columns by row (`SamplingRows`), prompt logprobs are looked for only while some request
owes them, and on CUDA the sampled tokens, any prompt logprobs and any pooled rows are read
in one sync, last (`_StepReads`).
With `--enable-lora`, each row's adapter is put in a slot and the step's tokens are grouped
by slot (`LoraManager.prepare`) before the forward; the C decode step adds the deltas in its
own products (each token's slot), the torch linears in theirs; a CUDA graph adds none, so a
step with adapters runs the eager forward on CUDA (`_forward`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ...common.config import WorkerConfig
from ...common.wire import KernelChoice
from .._step_batch import RunnerOutput, StepBatch
from ..attention._attention import AttentionBackend, QkvAttention, StepAttention
from ..cpu._cpu_decode import CpuStep
from ..cpu._cpu_linear import CpuFeatures
from ..layers._parallel import TensorParallel
from ..lora._lora import LoraManager
from ..models._model_config import ModelConfig
from ..models.llama import KVCache, LlamaForCausalLM
from ..sample._grammar_mask import apply_grammar_bitmask, step_bitmask
from ..sample._sampler import Sampler, SamplerOutput
from ..sample._sampling_batch import SamplingBatch
from ..sample._sampling_rows import SamplingRows
from ..sample._sampling_state import RequestSamplingState
from ..spec_decode import _verify
from ..spec_decode._draft_model import DraftModel
from ..spec_decode._speculator import StepDrafts
from ..worker._config import torch_dtype
from ._ahead import (
    AheadTokens,
    HostCopy,
    IdsPatch,
    PendingOutput,
    ReadyOutput,
    WithFailures,
    ids_patch,
)
from ._cuda_graphs import DecodeGraphs
from ._forward import FaultHook, Path, choose_path, expand_verify_rows
from ._input_batch import InputBatch, StepInputs
from ._pooler import Pooler
from ._prompt_embeds import Embeds, PromptEmbeds
from ._request_rows import RequestRows
from ._startup import RunnerStartup
from ._step_reads import AheadOutput, StepReads, prompt_logprobs, to_host


class ModelRunner(RunnerStartup, RequestRows):
    """Owns the model, the KV cache tensors and the per-request device-side state."""

    def __init__(
        self,
        config: WorkerConfig,
        model_config: ModelConfig,
        tp: TensorParallel,
        device: torch.device,
        *,
        cpu_features: CpuFeatures | None = None,
    ) -> None:
        """`cpu_features` replaces the CPU probe's answer (tests force either kernel path)."""
        self.config = config
        self.model_config = model_config
        self.tp = tp
        self.device = device
        self.dtype = torch_dtype(config, device)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.inputs = InputBatch(config.max_num_seqs, self.max_model_len, config.block_size)
        self.sampling: dict[int, RequestSamplingState] = {}  # generation requests only
        self.sampling_rows = SamplingRows(config.max_num_seqs)  # their options, by row
        self._owe_prompt_logprobs: set[int] = set()  # asked, and their prompt is not done
        self.pooler = Pooler()  # pooling requests (embeddings): they sample nothing
        self.prompt_embeds = PromptEmbeds(model_config.hidden_size)  # prompts sent as vectors
        self.sampler = Sampler()
        self.kv_caches: list[KVCache] = []
        self.attention: AttentionBackend | None = None  # made by init_kv_cache
        self.graphs: DecodeGraphs | None = None  # made by capture_cuda_graphs
        self.cpu_step: CpuStep | None = None  # made by load_model on CPU
        self.model: LlamaForCausalLM | None = None
        self.lora: LoraManager | None = None  # made by load_model with --enable-lora
        self._lora_fallback_logged = False
        self._lora_failed: dict[int, str] = {}  # this step's requests whose adapter failed
        self.kernels: KernelChoice | None = None  # chosen by load_model
        self._cpu_features = cpu_features
        self.faults = FaultHook(config, tp.rank)
        self.speculative = config.speculative()
        self.drafter: DraftModel | None = None  # a draft model's proposer (made by load_model)
        eos = model_config.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        self._ahead: AheadTokens | None = None  # the last step ahead's tokens, not yet read

    # -- one step ---------------------------------------------------------------------------

    def execute(
        self, batch: StepBatch, masks: Callable[[], np.ndarray] | None = None
    ) -> RunnerOutput:
        """Run one step; every rank runs it, rank 0's output is the one the engine reads.

        `masks` waits for the grammar bitmask of `batch.grammar_rnums` (computed while the
        forward runs); it is called after the forward, just before sampling.
        """
        return self._with_failures(self._execute(batch, masks, ahead=False)).result()

    def execute_ahead(
        self, batch: StepBatch, masks: Callable[[], np.ndarray] | None = None
    ) -> PendingOutput:
        """`execute`, its tokens read later (async scheduling, `_ahead`): the next step may
        run before `result()`, its rows past this step's tokens reading them on the device.
        Steps with drafts to verify or propose are synchronous (their output is ready)."""
        return self._with_failures(self._execute(batch, masks, ahead=True))

    def _with_failures(self, pending: PendingOutput) -> PendingOutput:
        """`pending`, naming the requests whose adapter could not be read this step."""
        failed, self._lora_failed = self._lora_failed, {}
        return WithFailures(pending, failed) if failed else pending

    @torch.inference_mode()
    def _execute(
        self, batch: StepBatch, masks: Callable[[], np.ndarray] | None, *, ahead: bool
    ) -> PendingOutput:
        if self.model is None or not self.kv_caches:
            raise RuntimeError("execute() before load_model() and init_kv_cache()")
        self._update_requests(batch)
        drafts = StepDrafts.of(batch)  # speculative decoding: the drafts this step verifies
        if drafts is not None:
            drafts.write(self.inputs, batch.scheduled_rnums)
        inputs = (
            self.inputs.prepare(batch.scheduled_rnums, batch.num_scheduled_tokens)
            if len(batch.scheduled_rnums)
            else None
        )
        fault = self.faults.arm(self.model, inputs)
        if inputs is None:
            return ReadyOutput(RunnerOutput(np.zeros(0, np.uint64), np.zeros(0, np.int32)))
        patch = self._ids_patch(inputs)
        embeds = None
        if self.prompt_embeds:
            rnums = batch.scheduled_rnums.tolist()
            embeds = self.prompt_embeds.for_step(rnums, inputs, self._tensor)
        adapted = self.lora is not None and self.lora.prepare(inputs.rows, inputs.counts)
        if adapted and self.lora is not None:  # rows whose adapter failed run without it
            self._lora_failed = self.lora.take_failures(inputs.rows, batch.scheduled_rnums)
        if adapted and self.graphs is not None:
            self._log_lora_fallback()
        # Graphs and the C step read token ids; graphs add no adapter delta (the C step does).
        torch_only = fault or embeds is not None or (adapted and self.graphs is not None)
        path = choose_path(
            inputs, self.graphs, self.cpu_step, fault=torch_only, verify=drafts is not None
        )
        hidden = self.hidden_states(path, inputs, embeds, patch)
        reads = StepReads(
            prompt_logprobs(
                batch,
                inputs,
                hidden,
                owed=self._owe_prompt_logprobs,
                sampling=self.sampling,
                rows=self.inputs,
                model=self.model,
                to_device=self._tensor,
            )
        )
        self.inputs.advance(inputs)
        samples = inputs.samples
        if self.pooler:
            is_pooling, reads.pooled_rnums, reads.pooled = self.pooler.pool(
                batch.scheduled_rnums.tolist(), inputs, hidden
            )
            samples = samples & ~is_pooling
        sampling = np.flatnonzero(samples)
        rnums = batch.scheduled_rnums[sampling]
        if not len(sampling):
            output = RunnerOutput(rnums, np.zeros(0, np.int32))
            reads.apply(output, to_host(*reads.tensors()))
            return ReadyOutput(output)
        last = inputs.token_starts[sampling] + inputs.counts[sampling] - 1
        if drafts is not None:
            states = [self.sampling[int(r)] for r in rnums]
            output = _verify.verify(
                batch,
                masks,
                drafts,
                inputs,
                hidden,
                sampling,
                states,
                reads,
                head=self.cpu_step or self.model,
                sampler=self.sampler,
                rows_state=self.inputs,
                sampling_rows=self.sampling_rows,
                sampling_batch=self._sampling_batch,
                to_device=self._tensor,
            )
        else:
            logits = (self.cpu_step or self.model).compute_logits(hidden[self._tensor(last)])
            if len(batch.grammar_rnums):
                bitmask = step_bitmask(batch, masks)
                apply_grammar_bitmask(logits, rnums, batch.grammar_rnums, bitmask)
            rows = inputs.rows[sampling]
            sampling_batch = self.sampling_rows.batch(
                rows,
                eos_token_id=self.eos_token_id,
                vocab_size=self.model_config.vocab_size,
                device=self.device,
            )
            sampled = self.sampler(logits, sampling_batch)
            if ahead and not batch.num_speculative_tokens:
                return self._finish_ahead(rows, rnums, sampled, reads)
            output = self._finish(rows, rnums, sampled, reads)
        if batch.num_speculative_tokens:
            output.draft_offsets, output.draft_token_ids = _verify.propose(
                self.speculative,
                self.drafter,
                self.inputs,
                batch.num_speculative_tokens,
                inputs.rows[sampling],
            )
        return ReadyOutput(output)

    def hidden_states(
        self, path: Path, inputs: StepInputs, embeds: Embeds | None, patch: IdsPatch | None = None
    ) -> torch.Tensor:
        """Hidden states of the step's tokens, by `path` (`choose_path`); `patch` sets the
        ids of rows past a step in flight (`_ids_patch`)."""
        assert self.model is not None
        if path is Path.C_STEP:
            assert self.cpu_step is not None
            ids, table = self._ids(inputs, patch), self._block_table(inputs)
            lora = None if self.lora is None else self.lora.batch.token_slots
            if len(inputs.input_ids) > len(inputs.rows):  # a verify step: a row per token
                context, table = expand_verify_rows(inputs.counts, inputs.positions, table)
                return self.cpu_step.run(
                    ids,
                    inputs.positions,
                    inputs.slots,
                    context,
                    table,
                    store_first=True,
                    lora_slots=lora,
                )
            return self.cpu_step.run(
                ids, inputs.positions, inputs.slots, inputs.context_lens, table, lora_slots=lora
            )
        positions = self.model.rotary.rope_positions(
            inputs.positions, inputs.counts, inputs.context_lens
        )
        if path is Path.GRAPH:
            assert self.graphs is not None
            return self.graphs.run(  # host arrays: one pinned copy into the graphs' inputs
                inputs.input_ids,
                positions,
                inputs.slots,
                inputs.context_lens,
                self._block_table(inputs),
                ids_patch=None if patch is None else lambda ids: patch.apply(ids, self._tensor),
            )
        meta: StepAttention | QkvAttention
        if path is Path.C_ATTENTION:
            assert self.cpu_step is not None
            table = self._block_table(inputs)
            meta = self.cpu_step.attention(inputs.positions, inputs.slots, inputs.counts, table)
        else:
            meta = self._attention_metadata(inputs)
        hidden: torch.Tensor = self.model(
            self._ids(inputs, patch), self._tensor(positions), self.kv_caches, meta, embeds
        )
        return hidden

    def _sampling_batch(self, states: list[RequestSamplingState]) -> SamplingBatch:
        return SamplingBatch.build(
            states,
            eos_token_id=self.eos_token_id,
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )

    def _finish(
        self,
        rows: np.ndarray,
        rnums: np.ndarray,
        sampled: SamplerOutput,
        reads: StepReads,
    ) -> RunnerOutput:
        """Read the step's tokens (and `reads` with them: the step's one sync on CUDA, after
        every other host step), then append them to `rows`."""
        token_ids, logprobs, topk_ids, topk_logprobs, *rest = to_host(
            sampled.token_ids.to(torch.int32),
            sampled.logprobs,
            sampled.topk_ids,
            sampled.topk_logprobs,
            *reads.tensors(),
        )
        assert token_ids is not None
        self.inputs.append_tokens(rows, token_ids)
        self.sampling_rows.append_outputs(rows, token_ids)
        output = RunnerOutput(
            rnums, token_ids, logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_logprobs
        )
        reads.apply(output, rest)
        return output

    def _finish_ahead(
        self, rows: np.ndarray, rnums: np.ndarray, sampled: SamplerOutput, reads: StepReads
    ) -> PendingOutput:
        """Count the step's tokens as appended (placeholders), queue their copy to the host,
        and return the output to read later; the next step's rows read them on the device."""
        tokens = sampled.token_ids.to(torch.int32)
        positions = self.inputs.append_placeholders(rows)
        ahead = AheadTokens(rows, self.inputs.generation[rows], positions, tokens)
        self._ahead = ahead
        copy = HostCopy(
            tokens, sampled.logprobs, sampled.topk_ids, sampled.topk_logprobs, *reads.tensors()
        )
        return AheadOutput(self._resolve, ahead, rnums, copy, reads)

    def _resolve(self, ahead: AheadTokens, token_ids: np.ndarray) -> None:
        """Write a step ahead's tokens, read at last, into the rows still holding them."""
        live = self.inputs.append_tokens_at(
            ahead.rows, ahead.generations, ahead.positions, token_ids
        )
        self.sampling_rows.append_outputs(ahead.rows[live], token_ids[live])
        if self._ahead is ahead:
            self._ahead = None

    def _ids_patch(self, inputs: StepInputs) -> IdsPatch | None:
        """The ids of this step's rows that are tokens of the step in flight (none when its
        output was read, as every synchronous step's is)."""
        if self._ahead is None:
            return None
        return ids_patch(
            self._ahead,
            self.inputs.generation,
            inputs.rows,
            inputs.counts,
            inputs.token_starts,
            inputs.positions,
        )

    def _ids(self, inputs: StepInputs, patch: IdsPatch | None) -> torch.Tensor:
        """The step's input ids on the device, `patch`ed."""
        ids = self._tensor(inputs.input_ids)
        if patch is not None:
            patch.apply(ids, self._tensor)
        return ids

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """Host array to the device; on CUDA through pinned memory, so the copy is async."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _block_table(self, inputs: StepInputs) -> np.ndarray:
        """The step's block table [B, width] (C order), as wide as its longest context."""
        width = int(-(-inputs.context_lens.max() // self.block_size))
        return np.ascontiguousarray(self.inputs.block_table[inputs.rows, :width])

    def _attention_metadata(self, inputs: StepInputs) -> StepAttention:
        assert self.attention is not None
        width = int(-(-inputs.context_lens.max() // self.block_size))
        tables = self.inputs.block_table[inputs.rows, :width]
        return self.attention.metadata(
            inputs.counts, inputs.context_lens, tables, inputs.slots, self._tensor
        )
