"""The engine's busy loop (DESIGN.md §6): one thread, one STEP record per step.

Idle, it sleeps on the request ring's doorbell (waking once a second to check the workers'
health). Busy, each iteration drains the request ring (ADD, ABORT, UTILITY, SHUTDOWN),
schedules, executes, drains again (so aborts that arrived during the forward drop their
tokens), updates, and writes one STEP record for every request that moved.

Structured outputs: a request with a grammar waits while it compiles in `Grammars`' threads
(the loop polls them each iteration, and naps at most `GRAMMAR_POLL_S` on the ring while
only compiles are pending); each step's grammar masks are computed while the forward runs.

Control calls (UTILITY): `_control`, where whatever a call raises is its answer, never the
engine's end. Paused or asleep, aborts are still reported, by a STEP record without a
forward (`_flush`). The request ring's records become scheduler calls in `_inbox`.
"""

from __future__ import annotations

import os
import sys
import time

import msgspec
import numpy as np

from ...common.wire import LoraModule, numbered
from ...gpu import PendingOutput, RunnerOutput, StepBatch
from ...transport_shm import RingReader, RingWriter
from ..protocol import _messages as P
from ..protocol._config import EngineConfig
from ..protocol._step_record import FinishReason, write_step
from ._control import Controls
from ._errors import WorkerDiedError
from ._grammar import Grammars
from ._inbox import GRAMMAR_POLL_S, IDLE_POLL_S, RequestInbox
from ._lora_registry import LoraRegistry
from .executor._executor import Executor
from .sched._async_scheduler import AsyncScheduler
from .sched._scheduler import Scheduler, SchedulerConfig, StepResult


class EngineCore(RequestInbox):
    """Owns the scheduler and the executor; talks to the frontend only through the rings."""

    def __init__(
        self, config: EngineConfig, requests: RingReader, outputs: RingWriter, executor: Executor
    ) -> None:
        self.config = config
        self.requests = requests
        self.outputs = outputs
        self.executor = executor
        self._encoder = msgspec.msgpack.Encoder()
        self._add_decoder = msgspec.msgpack.Decoder(P.AddHeader)
        self._utility_decoder = msgspec.msgpack.Decoder(P.UtilityCall)
        self._shutdown_decoder = msgspec.msgpack.Decoder(P.Shutdown)
        self._draining_until: float | None = None
        self._needs_flush = False  # aborts to report even if nothing else runs
        self._rejected: list[int] = []  # invalid ADDs: reported as ERROR rows
        # Control answers of calls read in the middle of a step, sent after its STEP record
        # (None: not in a step). A pause answered before the step it interrupted was written
        # let that step's tokens reach the frontend after the "paused" answer.
        self._answers_after_step: list[P.UtilityResult] | None = None
        self._grammars: Grammars | None = None  # made at the first structured request
        # The requests of the step being executed (None between steps): if the step raises,
        # the DEAD record names them (`RemoteError.step_rnums`). The scheduler's own array:
        # nothing is copied on the hot path for a death that rarely comes.
        self.step_rnums: np.ndarray | None = None
        self.is_paused = False  # `pause`: nothing is scheduled until `resume`
        self.sleep_level = 0  # `sleep`: 1 or 2 while asleep (no KV cache), 0 awake
        self.controls = Controls(self)
        # Async scheduling: the step executed ahead whose output is read after the next
        # step is executed (None: none in flight).
        self._pending: tuple[StepBatch, PendingOutput] | None = None

    @property
    def can_step(self) -> bool:
        return not self.is_paused and not self.sleep_level

    def start(self) -> None:
        """Executor (weights) -> KV cache size -> scheduler -> READY (DESIGN.md §6)."""
        num_blocks = self.executor.initialize()
        worker = self.config.worker
        model = self.executor.model_config
        self.max_model_len = self.executor.max_model_len
        scheduler = AsyncScheduler if self.config.async_scheduling else Scheduler
        self.scheduler = scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=worker.block_size,
                max_num_seqs=worker.max_num_seqs,
                max_num_batched_tokens=worker.max_num_batched_tokens,
                max_prefill_tokens_per_decode=worker.max_prefill_tokens_per_decode,
                speculative=worker.speculative(),
                max_model_len=self.max_model_len,
                enable_prefix_caching=self.config.enable_prefix_caching,
                hidden_size=model.hidden_size,
                max_loras=worker.max_loras,
            )
        )
        self.loras = LoraRegistry(self.executor, enabled=worker.enable_lora)
        for module in numbered(self.config.lora_modules):
            self._load_at_start(module)
        self.eos_token_id = model.eos_token_ids[0] if model.eos_token_ids else None
        ready = P.Ready(
            num_blocks,
            worker.block_size,
            self.max_model_len,
            model.vocab_size,
            list(model.eos_token_ids),
            model.bos_token_id,
            os.getpid(),
            self.executor.kernels,
            model.hidden_size,
            self.loras.loaded(),
        )
        self.outputs.send(P.READY, self._encoder.encode(ready), timeout=self.config.output_timeout)

    def _load_at_start(self, module: LoraModule) -> None:
        """Load a start-up adapter. One given by the user (no digest yet) that fails fails
        the start; one a restarted engine was handed (it loaded before: its digest) is
        skipped with the reason on stderr, and `Ready` leaves it out."""
        try:
            if not module.digest:
                module = self.controls.check_lora(module)
            self.loras.load(module)
        except WorkerDiedError:
            raise
        except Exception as exc:
            if not module.digest:
                raise
            print(f"trillm engine: skipped a LoRA adapter that no longer loads: {exc}",
                  file=sys.stderr, flush=True)  # fmt: skip

    def run(self) -> None:
        """Step until a SHUTDOWN is done: drained (or its deadline passed), or aborted."""
        while True:
            self._admit_compiled()
            self.controls.admit_loaded_loras()
            schedulable = self.can_step and self.scheduler.has_schedulable_requests()
            busy = schedulable or self._needs_flush or self._pending is not None
            compiling = self._grammars is not None and self._grammars.num_pending > 0
            compiling = compiling or self.controls.lora_loads.num_pending > 0
            # Idle and draining: nothing is left to wait for (blocking here cost a 1 s poll).
            self._drain_requests(
                block=not busy and (self._draining_until is None or compiling),
                timeout=GRAMMAR_POLL_S if compiling else IDLE_POLL_S,
            )
            if self._draining_until is not None and time.monotonic() >= self._draining_until:
                self._abort_all()
            if self.can_step and (self.scheduler.has_schedulable_requests() or self._needs_flush):
                self._step()
            elif self._pending is not None:  # nothing to run behind it: read it now
                self.finish_pending()
            elif self._needs_flush:  # paused or asleep: report the aborts without a step
                self._flush()
            elif self._draining_until is not None and not self.scheduler.has_unfinished_requests():
                return

    def _step(self) -> None:
        self._needs_flush = False
        scheduler = self.scheduler
        if isinstance(scheduler, AsyncScheduler):
            if self._pending is not None and not scheduler.may_schedule_ahead():
                self.finish_pending()  # the next step needs its tokens first
            batch = scheduler.schedule()
            if scheduler.is_ahead(batch):
                self._step_ahead(batch)
                return
        else:
            batch = scheduler.schedule()
        self.step_rnums = batch.scheduled_rnums
        masks = None
        if len(batch.grammar_rnums) and self._grammars is not None:
            masks = self._grammars.start_masks(
                self.scheduler.grammar_states(batch), self.scheduler.grammar_drafts(batch)
            )
        output = self.executor.execute(batch, masks)
        self._answers_after_step = []
        try:
            self._fail_alone(output.failed)
            self._drain_requests(block=False)  # aborts that arrived meanwhile drop their tokens
            result = self.scheduler.update_from_output(batch, output)
            self.step_rnums = None
            self._write(result)
            self._retire_loras()
        finally:
            answers, self._answers_after_step = self._answers_after_step, None
        for answer in answers:
            self._send_event(answer)

    def _step_ahead(self, batch: StepBatch) -> None:
        """Execute `batch` (scheduled ahead), then read and apply the step before it: on a
        GPU the host part of that step (its update, its STEP record) overlaps this one."""
        self.step_rnums = batch.scheduled_rnums
        pending = self.executor.execute_ahead(batch)  # no grammar rows: no masks
        previous, self._pending = self._pending, (batch, pending)
        self._answers_after_step = []
        try:
            if previous is not None:
                self._apply(*previous)
            self._drain_requests(block=False)  # aborts that arrived meanwhile drop their tokens
            if not self.can_step:  # paused or asleep meanwhile: its record before the answer
                self.finish_pending()
        finally:
            answers, self._answers_after_step = self._answers_after_step, None
        for answer in answers:
            self._send_event(answer)

    def finish_pending(self) -> None:
        """Read and apply the step in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._apply(*pending)

    def _apply(self, batch: StepBatch, pending: PendingOutput) -> None:
        self.step_rnums = batch.scheduled_rnums
        output = pending.result()
        self._fail_alone(output.failed)
        result = self.scheduler.update_from_output(batch, output)
        self.step_rnums = None
        self._write(result)
        self._retire_loras()

    def _fail_alone(self, failed: dict[int, str]) -> None:
        """End the requests a step failed alone (rnum -> why) with ERROR; their tokens go."""
        if not failed:
            return
        for request in self.scheduler.abort_requests(failed, reason=FinishReason.ERROR):
            why = failed[request.rnum]
            print(f"trillm engine: request {request.rnum} failed: {why}", file=sys.stderr)
            self._send_event(P.RequestError(request.rnum, why))

    def _flush(self) -> None:
        """Report aborts and rejected ADDs without scheduling (paused or asleep)."""
        self._needs_flush = False
        empty = RunnerOutput(np.zeros(0, np.uint64), np.zeros(0, np.int32))
        self._write(self.scheduler.update_from_output(self.scheduler.empty_batch(), empty))
        self._retire_loras()

    def _write(self, result: StepResult) -> None:
        for rnum, prompt in result.prompt_logprobs.items():
            event = P.PromptLogprobsChunk(
                rnum=rnum,
                first_position=prompt.first_position,
                k=0 if prompt.topk_ids is None else int(prompt.topk_ids.shape[1]),
                logprobs=prompt.logprobs.astype("<f4").tobytes(),
                topk_ids=b""
                if prompt.topk_ids is None
                else prompt.topk_ids.astype("<i4").tobytes(),
                topk_logprobs=b""
                if prompt.topk_logprobs is None
                else prompt.topk_logprobs.astype("<f4").tobytes(),
            )
            self._send_event(event)
        if self._rejected:
            result = _with_error_rows(result, self._rejected)
            self._rejected = []
        if not len(result.rnums):
            return
        write_step(
            self.outputs,
            result.step,
            result.rnums,
            result.tok_offsets,
            result.tokens,
            result.finish,
            logprobs=result.logprobs,
            topk_ids=result.topk_ids,
            topk_logprobs=result.topk_logprobs,
            num_cached_tokens=result.num_cached_tokens,
            pooled_rnums=result.pooled_rnums,
            pooled=result.pooled,
            timeout=self.config.output_timeout,
        )

    def held_loras(self) -> set[int]:
        return {r.lora_id for r in self.scheduler.requests.values() if r.lora_id}

    def _retire_loras(self) -> None:
        """Unloaded adapters whose last request ended leave the workers (`LoraRegistry`)."""
        if self.loras.retiring:
            self.loras.retire(self.held_loras())

    def answer(self, result: P.UtilityResult) -> None:
        """Send a control call's answer: after the STEP record of a step it was read in."""
        if self._answers_after_step is not None:
            self._answers_after_step.append(result)
        else:
            self._send_event(result)

    def _send_event(self, event: P.Event) -> None:
        self.outputs.send(P.EVENT, self._encoder.encode(event), timeout=self.config.output_timeout)


def _with_error_rows(result: StepResult, rnums: list[int]) -> StepResult:
    """`result` plus one row without tokens and finish ERROR per rejected request."""
    n = len(rnums)
    zeros_u32 = np.zeros(n, np.uint32)
    # Error rows carry no tokens, so the per-token columns stay as they are.
    return StepResult(
        result.step,
        np.concatenate([result.rnums, np.asarray(rnums, np.uint64)]),
        np.concatenate([result.tok_offsets, np.full(n, result.tok_offsets[-1], np.uint32)]),
        result.tokens,
        np.concatenate([result.finish, np.full(n, FinishReason.ERROR, np.uint8)]),
        np.concatenate([result.num_cached_tokens, zeros_u32]),
        result.logprobs,
        result.topk_ids,
        result.topk_logprobs,
        result.prompt_logprobs,
        result.pooled_rnums,
        result.pooled,
    )
