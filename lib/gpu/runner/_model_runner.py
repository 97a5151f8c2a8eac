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

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from ...common.config import WorkerConfig
from ...common.wire import KernelChoice, LoraModule
from .._step_batch import PromptLogprobs, RunnerOutput, StepBatch
from ..attention._attention import AttentionBackend, QkvAttention, StepAttention, TorchAttention
from ..cpu import _native
from ..cpu._cpu_decode import CpuStep, build_cpu_step
from ..cpu._cpu_linear import CpuFeatures
from ..cpu._decode_probe import decode_paths
from ..cpu._hugepages import huge_zeros
from ..cpu._prompt_linears import tiled_linears, use_tiles
from ..layers._parallel import TensorParallel
from ..loader._weights import Weights
from ..lora._lora import LoraManager
from ..lora._lora_files import LoraAdapterError
from ..models import family_for
from ..models._model_config import ModelConfig
from ..models.llama import KVCache, LlamaForCausalLM
from ..sample._grammar_mask import apply_grammar_bitmask, step_bitmask
from ..sample._sampler import Sampler, SamplerOutput, compute_logprobs
from ..sample._sampling_batch import RequestSamplingState, SamplingBatch
from ..sample._sampling_rows import SamplingRows
from ..spec_decode._draft_model import DraftModel
from ..spec_decode._ngram import propose_rows
from ..spec_decode._speculator import StepDrafts
from ..worker._config import quantization_for, torch_dtype
from ..worker._kv_budget import margin_note
from ..worker._startup_log import StartupLog
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
from ._kernels import choose_kernels, fused_kernels_for
from ._pooler import Pooler
from ._prompt_embeds import Embeds, PromptEmbeds


class ModelRunner:
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

    # -- start-up ---------------------------------------------------------------------------

    def load_model(self, weights: Weights | None, log: StartupLog | None = None) -> None:
        """Build the model on the device and load `weights` (None: random, for benchmarks),
        timing each phase into `log`."""
        log = log or StartupLog(enabled=False)
        # Chosen first: an unsupported explicit choice fails before any weight is read.
        self.kernels = choose_kernels(
            self.device,
            self.dtype,
            self.config.cpu_linear,
            self._cpu_features,
            self.config.attention_backend_for(self.device),
            quantization_for(self.config, self.device),
        )
        torch.manual_seed(self.config.seed)
        family = family_for(self.model_config.model_type)
        assert family is not None  # ModelConfig.from_dict accepts only registered types
        model_class: type[LlamaForCausalLM] = family.load().MODEL
        with log.phase("model built and weights loaded"):
            with torch.device(self.device):
                model = model_class(self.model_config, self.tp, self.dtype)
            if weights is None:
                for param in model.parameters():
                    param.data.normal_(0.0, 0.02)
            else:
                model.load_weights(weights, keep_quantized=self.kernels.quantization == "gguf")
        if self.config.enable_lora:
            self.lora = LoraManager(
                model,
                self.model_config,
                self.tp,
                max_loras=self.config.max_loras,
                max_rank=self.config.max_lora_rank,
                max_cpu_loras=self.config.num_cpu_loras,
                max_rows=self.config.max_num_seqs,
                dtype=self.dtype,
                device=self.device,
                cache_dir=self.config.lora_cache_dir,
            )
        if self.device.type == "cpu":  # before packing: it tiles the dense weights
            with log.phase("C decode step") as notes:
                built = len(_native.BUILT)
                self.cpu_step, decode = build_cpu_step(model, self.config, self.block_size)
                compiled = _native.BUILT[built:]
                notes.append(f"(built {', '.join(compiled)})" if compiled else "(cached kernels)")
                if self.cpu_step is None:
                    notes[-1] = "(off)"
            self.kernels = msgspec.structs.replace(self.kernels, decode=decode)
        if self.kernels.linear == "onednn":
            with log.phase("linears packed for oneDNN"):
                model.pack_linears()
        if fused_kernels_for(self.device, self.config.attention_backend_for(self.device)):
            model.use_fused()
        self.model = model.eval()
        if self.cpu_step is not None and self.config.cpu_decode == "auto":
            self._measure_decode_paths(self.cpu_step, log)
        spec = self.speculative
        if spec is not None and spec.model is not None:
            with log.phase("draft model loaded"):
                self.drafter = DraftModel.load(
                    self.config,
                    spec.model,
                    self.tp,
                    self.device,
                    self.inputs,
                    self.model_config.vocab_size,
                )

    def _measure_decode_paths(self, step: CpuStep, log: StartupLog) -> None:
        """Time the C step against the torch forward (packed as it will serve) per decode
        step size, or read the last start-up's timings (`_decode_probe`), and say which
        path takes which size in `KernelChoice.decode`. Here at load, not over the KV cache:
        the choice leaves a worker process before the cache is allocated."""
        assert self.model is not None and self.kernels is not None
        with log.phase("decode paths") as notes:
            step.paths = decode_paths(
                step,
                self.model,
                isa=self.kernels.isa,
                linear=self.kernels.linear,
                kv_budget=self.config.kv_cache_bytes,
            )
            measured = "measured" if step.paths.timings else "not measured"
            notes.append("read from the cache" if step.paths.cached else measured)
            if step.paths.prompt is not None and step.paths.prompt.tiles_win:
                use_tiles(tiled_linears(step, self.model))  # oneDNN's copies let go
        self.kernels = msgspec.structs.replace(self.kernels, decode=step.describe())

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on this rank, over every layer (K and V)."""
        cfg = self.model_config
        heads = self.tp.split(cfg.num_kv_heads, "num_key_value_heads")
        element = torch.empty(0, dtype=self.dtype).element_size()
        draft = 0 if self.drafter is None else self.drafter.kv_bytes_per_block()
        return 2 * cfg.num_layers * self.block_size * heads * cfg.head_dim * element + draft

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks of K and V per layer."""
        cfg = self.model_config
        heads = self.tp.split(cfg.num_kv_heads, "num_key_value_heads")
        shape = (num_blocks, self.block_size, heads, cfg.head_dim)
        if self.attention is None:
            self.attention = self._attention_backend(heads)
        if self.device.type == "cpu":  # the C step streams it: on huge pages (`_hugepages`)
            caches = [
                (huge_zeros(shape, self.dtype), huge_zeros(shape, self.dtype))
                for _ in range(cfg.num_layers)
            ]
            for k, v in caches:  # its pages held from now, as torch.zeros held them: the
                k.zero_()  # budget is taken at start-up (and given back by sleep), and no
                v.zero_()  # step faults them in
            self.bind_kv_cache(caches)
        else:
            self.bind_kv_cache(
                [
                    (
                        torch.zeros(shape, dtype=self.dtype, device=self.device),
                        torch.zeros(shape, dtype=self.dtype, device=self.device),
                    )
                    for _ in range(cfg.num_layers)
                ]
            )
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)

    def bind_kv_cache(self, kv_caches: list[KVCache]) -> None:
        """Make `kv_caches` the cache the steps run over (the C step's too; [] unbinds it)."""
        self.kv_caches = kv_caches
        if self.cpu_step is not None and kv_caches:
            self.cpu_step.bind(kv_caches)
        elif self.cpu_step is not None:
            self.cpu_step.unbind()

    def free_kv_cache(self) -> int:
        """Drop the KV cache and the graphs over it (they hold its addresses, and the
        weights'); return its size in blocks (0: there was none), for `Worker.wake_up`."""
        num_blocks = int(self.kv_caches[0][0].shape[0]) if self.kv_caches else 0
        self.graphs = None
        if self.drafter is not None:
            self.drafter.free_kv_cache()
        self.bind_kv_cache([])
        return num_blocks

    def _attention_backend(self, kv_heads: int) -> AttentionBackend:
        cfg = self.model_config
        if self.config.attention_backend_for(self.device) == "triton":
            from ..attention._attention_triton import (
                TritonAttention,  # imports triton: only when chosen
            )

            heads = self.tp.split(cfg.num_heads, "num_attention_heads")
            return TritonAttention(heads, kv_heads, cfg.head_dim, self.block_size, self.device)
        block_numel = self.block_size * kv_heads * cfg.head_dim
        return TorchAttention(self.block_size, block_numel, self.dtype, self.device)

    def graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes `capture_cuda_graphs` will capture on CUDA (() if none)."""
        from ..attention._attention_triton import TritonAttention

        if self.tp.world_size > 1 or not isinstance(self.attention, TritonAttention):
            return ()
        return tuple(sorted(self.config.cuda_graph_sizes()))

    def capture_cuda_graphs(self, *, off_cuda: bool = False, margin: int = 0) -> str:
        """Capture decode graphs (after `init_kv_cache`); returns the line to log, with the
        pool's size against the `margin` kept for it when the KV cache was sized.

        `off_cuda` builds the static, padded buffers on CPU too (no graph: tests).
        """
        sizes = self.config.cuda_graph_sizes()
        if self.device.type != "cuda" and not off_cuda:
            return "cuda graphs: none (not on CUDA)"
        if not sizes:
            return "cuda graphs: none (--enforce-eager)"
        if self.tp.world_size > 1:
            return "cuda graphs: none (tensor parallel steps run eager)"
        from ..attention._attention_triton import TritonAttention

        if not isinstance(self.attention, TritonAttention):
            return (
                "cuda graphs: none (the torch attention backend's shapes change with each "
                "step; use --attention-backend triton)"
            )
        assert self.model is not None
        max_blocks = self.inputs.block_table.shape[1]
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.attention, sizes, max_blocks, self.device
        )
        report = graphs.capture()
        self.graphs = graphs
        return report.describe() + margin_note(report.bytes, margin)

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
        hidden = self._forward(path, inputs, embeds, patch)
        reads = _StepReads(self._prompt_logprobs(batch, inputs, hidden))
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
            reads.apply(output, _to_host(*reads.tensors()))
            return ReadyOutput(output)
        last = inputs.token_starts[sampling] + inputs.counts[sampling] - 1
        if drafts is not None:
            states = [self.sampling[int(r)] for r in rnums]
            output = self._verify(batch, masks, drafts, inputs, hidden, sampling, states, reads)
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
            output.draft_offsets, output.draft_token_ids = self._propose(
                batch.num_speculative_tokens, inputs.rows[sampling]
            )
        return ReadyOutput(output)

    def _verify(
        self,
        batch: StepBatch,
        masks: Callable[[], np.ndarray] | None,
        drafts: StepDrafts,
        inputs: StepInputs,
        hidden: torch.Tensor,
        sampling: np.ndarray,
        states: list[RequestSamplingState],
        reads: _StepReads,
    ) -> RunnerOutput:
        """Sample every position of the rows with drafts and keep what they accept
        (`_speculator`); the others sample their one position as usual. `reads` are read
        with the sampled tokens."""
        rnums = batch.scheduled_rnums[sampling]
        last = inputs.token_starts[sampling] + inputs.counts[sampling] - 1
        index = drafts.logit_index(sampling, last)
        assert self.model is not None
        logits = (self.cpu_step or self.model).compute_logits(hidden[self._tensor(index)])
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
        sampled = self.sampler(logits, self._sampling_batch(positioned))
        token_ids, logprobs, topk_ids, topk_logprobs, *rest = _to_host(
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
        self.inputs.num_computed[rows] -= positions - 1 - accepted.num_accepted
        tokens = token_ids[keep]
        self.inputs.append_token_runs(rows, accepted.token_offsets, tokens)
        self.sampling_rows.append_runs(rows, accepted.token_offsets, tokens)
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

    def _propose(self, k: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each of `rows`' drafts for the next step (at most k; offsets and tokens)."""
        spec = self.speculative
        if spec is None:
            raise RuntimeError("a step asked for drafts, but speculative decoding is off")
        if self.drafter is not None:
            return self.drafter.propose(self.inputs, rows, k)
        return propose_rows(
            self.inputs.token_ids,
            self.inputs.num_tokens,
            rows,
            k,
            min_n=spec.prompt_lookup_min,
            max_n=spec.prompt_lookup_max,
        )

    def _forward(
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
        reads: _StepReads,
    ) -> RunnerOutput:
        """Read the step's tokens (and `reads` with them: the step's one sync on CUDA, after
        every other host step), then append them to `rows`."""
        token_ids, logprobs, topk_ids, topk_logprobs, *rest = _to_host(
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
        self, rows: np.ndarray, rnums: np.ndarray, sampled: SamplerOutput, reads: _StepReads
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
        return _AheadOutput(self, ahead, rnums, copy, reads)

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

    def _prompt_logprobs(
        self, batch: StepBatch, inputs: StepInputs, hidden: torch.Tensor
    ) -> list[_PendingPromptLogprobs]:
        """Logprobs of the prompt tokens this step covers, for requests that asked (echo),
        still on the device (read with the sampled tokens). Python only over the requests
        that owe some: none in most steps."""
        owed = self._owe_prompt_logprobs
        if not owed:
            return []
        scheduled = batch.scheduled_rnums
        asked = np.isin(scheduled, np.fromiter(owed, np.uint64, len(owed)))
        result: list[_PendingPromptLogprobs] = []
        for i in np.flatnonzero(asked).tolist():
            rnum = int(scheduled[i])
            k = self.sampling[rnum].options.prompt_logprobs
            assert k is not None  # owed only by requests that asked
            row = int(inputs.rows[i])
            prompt_len = int(self.inputs.num_prompt_tokens[row])
            start = int(inputs.context_lens[i] - inputs.counts[i])
            end = min(int(inputs.context_lens[i]), prompt_len - 1)  # positions that score p+1
            if end >= prompt_len - 1:
                owed.discard(rnum)  # its last prompt position is scored now (or was)
            if start >= end:
                continue
            first = int(inputs.token_starts[i])
            assert self.model is not None
            logits = self.model.compute_logits(hidden[first : first + end - start])
            targets = self._tensor(self.inputs.token_ids[row, start + 1 : end + 1].astype(np.int64))
            tensors = compute_logprobs(logits, targets, k)
            result.append(_PendingPromptLogprobs(rnum, start + 1, tensors))
        return result


class _AheadOutput:
    """A step ahead's output (`execute_ahead`): `result()` reads it and appends its tokens."""

    def __init__(
        self,
        runner: ModelRunner,
        ahead: AheadTokens,
        rnums: np.ndarray,
        copy: HostCopy,
        reads: _StepReads,
    ) -> None:
        self._runner, self._ahead, self._rnums = runner, ahead, rnums
        self._copy, self._reads = copy, reads
        self._output: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._output is None:
            token_ids, logprobs, topk_ids, topk_logprobs, *rest = self._copy.wait()
            assert token_ids is not None
            self._runner._resolve(self._ahead, token_ids)
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


class _PendingPromptLogprobs(NamedTuple):
    """One request's prompt logprobs of a step, before they are read to the host."""

    rnum: int
    first_position: int
    tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass(slots=True)
class _StepReads:
    """A step's device results besides the sampled tokens: read to the host with them, in
    the step's one sync on CUDA (`_to_host`), then set on its output."""

    prompt_logprobs: list[_PendingPromptLogprobs]
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


def _numpy(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else tensor.cpu().numpy()


def _to_host(*tensors: torch.Tensor | None) -> list[np.ndarray | None]:
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
