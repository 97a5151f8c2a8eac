"""Executors: how the engine runs a step on its workers.

- `UniprocExecutor`: the worker lives in the engine process (TP = 1; two processes in all).
- `MultiprocExecutor` (`_executor_multiproc`): one worker process per rank, steps through a
  broadcast ring, results and failures through one ring per rank, processes watched.
- `NullExecutor`: no model; deterministic tokens after a simulated step time, so host
  overhead can be measured through the real scheduler and rings.

Every executor raises `WorkerDiedError` (naming the rank, the exception or the exit) instead
of returning when a worker failed; no call waits forever on a dead rank.
"""

from __future__ import annotations

import abc
import hashlib
import time
from collections.abc import Callable

import numpy as np

from ....common.wire import LoraModule
from ....gpu import (
    KernelChoice,
    ModelConfig,
    PendingOutput,
    ReadyOutput,
    RunnerOutput,
    StepBatch,
    Worker,
    WorkerConfig,
    WorkerFailure,
    step_bitmask,
)
from ...protocol._errors import RemoteError
from .._errors import WorkerDiedError

Masks = Callable[[], np.ndarray]  # waits for a step's grammar bitmask


class Executor(abc.ABC):
    """Loads the model on every rank, sizes the KV cache, and runs steps."""

    model_config: ModelConfig
    max_model_len: int
    kernels: KernelChoice | None = None  # rank 0's, once initialized (None: no model)
    reads_adapters = True  # its ranks read LoRA files (the null executor: none)

    @abc.abstractmethod
    def initialize(self) -> int:
        """Load the model everywhere, allocate the KV cache; return its number of blocks."""

    @abc.abstractmethod
    def execute(self, batch: StepBatch, masks: Masks | None = None) -> RunnerOutput:
        """Run one step; rank 0's output. `masks` waits for the grammar bitmask of
        `batch.grammar_rnums` (being computed meanwhile); call it only before sampling.

        Raises:
            WorkerDiedError: a rank raised or exited.
        """

    def execute_ahead(self, batch: StepBatch, masks: Masks | None = None) -> PendingOutput:
        """Run one step whose output may be read later (async scheduling): the next step
        may be executed before `result()`. Here the step is synchronous, its output ready
        (the multiprocess and null executors: correct, without the overlap).

        Raises:
            WorkerDiedError: a rank raised or exited (here or at `result()`).
        """
        return ReadyOutput(self.execute(batch, masks))

    def check_health(self) -> None:  # noqa: B027 - most executors have nothing to check
        """Raise `WorkerDiedError` if a worker died while the engine was idle."""

    def sleep(self, level: int) -> None:  # noqa: B027 - the null executor holds nothing
        """Free the KV cache on every rank (level 2: the weights go to host memory too).
        No step runs until `wake_up`; the KV cache's contents are lost."""

    def wake_up(self) -> None:  # noqa: B027
        """Undo `sleep`: weights back on the device, a fresh KV cache of the same size."""

    def add_lora(self, module: LoraModule) -> str:
        """Have every rank read and check adapter `module`; return its digest (its identity
        in the prefix cache). The null executor reads nothing: the digest names the path.

        Raises:
            LoraAdapterError: it cannot be served (rank 0's message; nothing changed).
        """
        return hashlib.sha256(f"{module.name}\0{module.path}".encode()).hexdigest()

    def remove_lora(self, lora_id: int) -> None:  # noqa: B027
        """Every rank forgets adapter `lora_id` for new requests; running ones keep it."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold (idempotent)."""


def failure_error(failure: WorkerFailure) -> WorkerDiedError:
    return WorkerDiedError(
        RemoteError(
            f"worker rank {failure.rank}",
            failure.exc_type,
            failure.message,
            failure.traceback,
            function=failure.function,
        )
    )


class UniprocExecutor(Executor):
    """The worker inside the engine process: no ring, no copy, no extra process."""

    def __init__(self, config: WorkerConfig) -> None:
        self.worker = Worker(config)

    def initialize(self) -> int:
        worker = self.worker
        worker.init_device()
        worker.load_model()
        num_blocks = worker.num_available_kv_blocks()
        worker.init_kv_cache(num_blocks)
        self.model_config = worker.runner.model_config
        self.max_model_len = worker.runner.max_model_len
        self.kernels = worker.kernels
        return num_blocks

    def execute(self, batch: StepBatch, masks: Masks | None = None) -> RunnerOutput:
        try:
            return self.worker.execute(batch, masks)
        except Exception as exc:
            raise failure_error(WorkerFailure.from_exception(0, exc)) from exc

    def execute_ahead(self, batch: StepBatch, masks: Masks | None = None) -> PendingOutput:
        try:
            return _Guarded(self.worker.execute_ahead(batch, masks))
        except Exception as exc:
            raise failure_error(WorkerFailure.from_exception(0, exc)) from exc

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self) -> None:
        self.worker.wake_up()

    def add_lora(self, module: LoraModule) -> str:
        return self.worker.add_lora(module)

    def remove_lora(self, lora_id: int) -> None:
        self.worker.remove_lora(lora_id)

    def shutdown(self) -> None:
        self.worker.shutdown()


class _Guarded:
    """A pending output whose failure at `result()` (a CUDA error surfaces at the wait) is
    the worker's death, as `execute`'s."""

    def __init__(self, pending: PendingOutput) -> None:
        self._pending = pending

    def result(self) -> RunnerOutput:
        try:
            return self._pending.result()
        except Exception as exc:
            raise failure_error(WorkerFailure.from_exception(0, exc)) from exc


class NullExecutor(Executor):
    """No model: token `(rnum + step) % 1000 + 100` for every sampling row after `step_time`.

    A row samples when the step reaches the end of its known tokens, exactly as the runner
    decides, so the scheduler's chunked prefill and stop conditions run for real. A row under
    a grammar takes the lowest token its mask allows, so structured requests run for real too
    (and their mask cost is measured without a model).
    """

    reads_adapters = False

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        step_time: float = 0.0,
    ) -> None:
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.step_time = step_time
        self._lengths: dict[int, list[int]] = {}  # rnum -> [num_tokens, num_computed]

    def initialize(self) -> int:
        return self.num_blocks

    def execute(self, batch: StepBatch, masks: Masks | None = None) -> RunnerOutput:
        started = time.perf_counter()
        lengths = self._lengths
        for rnum in batch.finished_rnums.tolist():
            lengths.pop(rnum, None)
        for request in batch.new_requests:
            total = len(request.prompt_token_ids) + len(request.output_token_ids)
            lengths[request.rnum] = [total, request.num_computed_tokens]
        for rnum, computed in zip(
            batch.cached_rnums.tolist(), batch.cached_num_computed.tolist(), strict=True
        ):
            lengths[rnum][1] = computed
        sampled = []
        for rnum, count in zip(
            batch.scheduled_rnums.tolist(), batch.num_scheduled_tokens.tolist(), strict=True
        ):
            state = lengths[rnum]
            state[1] += count
            if state[1] >= state[0]:
                state[0] += 1
                sampled.append(rnum)
        rnums = np.array(sampled, np.uint64)
        tokens = ((rnums + np.uint64(batch.step)) % np.uint64(1000) + np.uint64(100)).astype(
            np.int32
        )
        if len(batch.grammar_rnums):
            row_of = {rnum: i for i, rnum in enumerate(sampled)}
            bitmask = step_bitmask(batch, masks)
            bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
            for rnum, allowed in zip(batch.grammar_rnums.tolist(), bits, strict=True):
                tokens[row_of[rnum]] = int(np.argmax(allowed))
        remaining = self.step_time - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return RunnerOutput(rnums, tokens)

    def shutdown(self) -> None:
        self._lengths.clear()
