"""The frontend's configuration: `LLMConfig` wraps the engine's and adds what only the frontend
process uses (tokenizer, start and shutdown deadlines, the watchdog)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import msgspec

from ..protocol._config import EngineConfig
from ..protocol._messages import MIN_WATCHDOG_TIMEOUT
from ._grammar_budget import MAX_GRAMMAR_BYTES, MAX_STRUCTURED_DEPTH, GrammarBudget
from ._regex_size import MAX_REGEX_OPTIONALS


@dataclass(frozen=True)
class LLMConfig:
    """The frontend's configuration (the engine's is inside)."""

    engine: EngineConfig
    tokenizer: str | None = None  # default: the model directory
    chat_template: str | None = None  # a Jinja file to use instead of the tokenizer's
    # "deepseek_r1" or "qwen3": the model reasons in <think>...</think> first, and output
    # constraints apply only after it (`_structured.after_reasoning`).
    reasoning_parser: str | None = None
    start_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    # Seconds without the engine's heartbeat before it is declared dead and killed (0: never).
    watchdog_timeout: float = 30.0
    # Engine processes, each with its own rings, scheduler, KV cache (and TP group).
    data_parallel_size: int = 1
    # A dead engine is started again at most this often within the window (0: never; the
    # server's default is 3 in 300 s, `--max-engine-restarts`); its open requests resume.
    max_engine_restarts: int = 0
    engine_restart_window: float = 300.0
    # Seconds a request arriving while every engine restarts waits for one; past that it
    # raises `EngineRestartingError` (HTTP: 503 with Retry-After).
    engine_restart_wait: float = 30.0
    # The engine core on a thread of this process (`_inproc`, vLLM's InprocClient), for
    # debugging: one py-spy dump shows everything. The watchdog is off (a thread cannot be
    # killed); data parallelism is refused.
    in_process: bool = False
    # How deep and how large a request's schema or grammar may be (`_grammar_budget`; the
    # server's --structured-outputs-max-depth, -max-bytes and -max-regex-optionals).
    structured_outputs_max_depth: int = MAX_STRUCTURED_DEPTH
    structured_outputs_max_bytes: int = MAX_GRAMMAR_BYTES
    structured_outputs_max_regex_optionals: int = MAX_REGEX_OPTIONALS

    def __post_init__(self) -> None:
        self.grammar_budget  # noqa: B018 - built to refuse a bad limit here, at the edge
        if self.in_process and self.data_parallel_size > 1:
            raise ValueError(
                f"an in-process engine is one engine: data_parallel_size must be 1 with "
                f"in_process, got {self.data_parallel_size}"
            )
        if self.engine_restart_wait < 0:
            raise ValueError(f"engine_restart_wait must be >= 0, got {self.engine_restart_wait}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.watchdog_timeout != 0 and self.watchdog_timeout < MIN_WATCHDOG_TIMEOUT:
            raise ValueError(
                f"the engine watchdog timeout must be 0 (off) or at least "
                f"{MIN_WATCHDOG_TIMEOUT} s (the heartbeat's jitter), got {self.watchdog_timeout}"
            )

    @property
    def grammar_budget(self) -> GrammarBudget:
        return GrammarBudget(
            max_depth=self.structured_outputs_max_depth,
            max_bytes=self.structured_outputs_max_bytes,
            max_regex_optionals=self.structured_outputs_max_regex_optionals,
        )

    def engine_configs(self) -> list[EngineConfig]:
        """One config per data-parallel engine: on CUDA each takes the next TP-size GPUs; on
        one CPU the engines split its cores."""
        engine = self.engine
        worker = engine.worker
        size = self.data_parallel_size
        if size == 1:
            return [engine]
        kind, _, index = worker.device_name().partition(":")  # "auto" resolved
        if kind != "cuda":
            cores = len(os.sched_getaffinity(0))
            threads = max(1, cores // (size * engine.tensor_parallel_size))
            return [msgspec.structs.replace(engine, cpu_threads=threads)] * size
        base = int(index or 0)
        step = engine.tensor_parallel_size
        return [
            msgspec.structs.replace(
                engine,
                worker=dataclasses.replace(worker, device=f"cuda:{base + i * step}"),
            )
            for i in range(size)
        ]
