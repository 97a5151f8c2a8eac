"""The frontend's configuration: `LLMConfig` wraps the engine's and adds what only the frontend
process uses (chat template, start and shutdown deadlines, the watchdog, restarts)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import msgspec

from ...common.flags import flag
from ..protocol._config import EngineConfig
from ..protocol._messages import MIN_WATCHDOG_TIMEOUT
from .inputs._grammar_budget import MAX_GRAMMAR_BYTES, MAX_STRUCTURED_DEPTH, GrammarBudget
from .inputs._regex_size import MAX_REGEX_OPTIONALS
from .inputs._structured import REASONING_PARSERS
from .outputs._pooling import parse_pooler_override


@dataclass(frozen=True)
class LLMConfig:
    """The frontend's configuration (the engine's is inside)."""

    engine: EngineConfig
    # Default: the model directory. The engine's `tokenizer` is the one setting (its
    # structured outputs read the same files): given here, it is set there; this reads it.
    tokenizer: str | None = None
    chat_template: str | None = field(
        default=None,  # a Jinja file to use instead of the tokenizer's
        metadata=flag("--chat-template", help="a Jinja chat template file to use instead"),
    )
    # "deepseek_r1" or "qwen3": the model reasons in <think>...</think> first, and output
    # constraints apply only after it (`_structured.after_reasoning`). The server's HTTP
    # layer splits the reasoning off with the same parser (`ServerConfig` copies it).
    reasoning_parser: str | None = field(
        default=None,
        metadata=flag(
            "--reasoning-parser",
            choices=REASONING_PARSERS,
            help="split <think>...</think> off into message.reasoning",
        ),
    )
    # Embeddings' pooler (JSON: pooling_type LAST|MEAN|CLS|ALL, normalize): overrides what
    # the model folder's sentence-transformers files say (`_pooling.load_pooler_config`).
    pooler_config: str | None = field(
        default=None,
        metadata=flag(
            "--pooler-config",
            help='embeddings\' pooler, as JSON: {"pooling_type": "LAST|MEAN|CLS|ALL", '
            '"normalize": true|false}; overrides the model\'s sentence-transformers files '
            "(default without either: LAST, normalized)",
        ),
    )
    # vLLM's: completions may send their prompt as embeddings (`_prompt_embeds`); off, such
    # a request is a 400. Off by default, as vLLM: embeddings skip the tokenizer's checks.
    enable_prompt_embeds: bool = field(
        default=False,
        metadata=flag(
            "--enable-prompt-embeds",
            help="accept prompt_embeds on /v1/completions: base64 of a safetensors file of one "
            "float tensor [tokens, hidden] (never a pickle)",
        ),
    )
    start_timeout: float = 600.0
    # The server's one shutdown deadline: in-flight requests, then the engine's drain.
    shutdown_timeout: float = field(default=30.0, metadata=flag("--shutdown-timeout"))
    # Seconds without the engine's heartbeat before it is declared dead and killed (0: never).
    watchdog_timeout: float = field(
        default=30.0,
        metadata=flag(
            "--engine-watchdog-timeout",
            help="seconds without the engine's heartbeat (a stopped or frozen engine) before it "
            "is declared dead and killed; 0 turns the watchdog off",
        ),
    )
    # Engine processes, each with its own rings, scheduler, KV cache (and TP group).
    data_parallel_size: int = field(
        default=1,
        metadata=flag(
            "--data-parallel-size",
            "-dp",
            help="engine processes, each with its own scheduler and KV cache (and TP group); "
            "requests go by load, with prefix affinity",
        ),
    )
    # A dead engine is started again at most this often within the window (0: never; the
    # server's default is 3 in 300 s); its open requests resume.
    max_engine_restarts: int = field(
        default=0,
        metadata=flag(
            "--max-engine-restarts",
            cli_default=3,
            help="start a dead engine again at most this often within --engine-restart-window "
            "(its open requests resume on it; new ones wait for it); past that, exit 1 as "
            "without",
        ),
    )
    engine_restart_window: float = field(
        default=300.0, metadata=flag("--engine-restart-window", help="seconds")
    )
    # Seconds a request arriving while every engine restarts waits for one; past that it
    # raises `EngineRestartingError` (HTTP: 503 with Retry-After).
    engine_restart_wait: float = field(
        default=30.0,
        metadata=flag(
            "--engine-restart-wait",
            help="seconds a request arriving while the engine restarts waits for it; past that "
            "it gets 503 with Retry-After",
        ),
    )
    # The engine core on a thread of this process (`_inproc`, vLLM's InprocClient), for
    # debugging: one py-spy dump shows everything. The watchdog is off (a thread cannot be
    # killed); data parallelism is refused.
    in_process: bool = field(
        default=False,
        metadata=flag(
            "--engine-in-process",
            help="run the engine core on a thread of the API server's process (vLLM's "
            "InprocClient), for debugging: one py-spy dump shows everything; no watchdog",
        ),
    )
    # How deep and how large a request's schema or grammar may be (`_grammar_budget`).
    structured_outputs_max_depth: int = field(
        default=MAX_STRUCTURED_DEPTH,
        metadata=flag(
            "--structured-outputs-max-depth",
            help="how deep a request's JSON schema (objects on one path, $refs followed) or "
            "grammar (rules on one chain of references) may nest; deeper is a 400, before the "
            "compiler sees it (a chain of thousands overflows its stack)",
        ),
    )
    structured_outputs_max_bytes: int = field(
        default=MAX_GRAMMAR_BYTES,
        metadata=flag(
            "--structured-outputs-max-bytes",
            help="the largest JSON schema, regex or grammar a request may send; larger is a 400",
        ),
    )
    structured_outputs_max_regex_optionals: int = field(
        default=MAX_REGEX_OPTIONALS,
        metadata=flag(
            "--structured-outputs-max-regex-optionals",
            help="the most optional items (? or *) one regex or grammar terminal may hold; "
            "more is a 400 (their compile time grows with the square of their number)",
        ),
    )

    def __post_init__(self) -> None:
        own, engines = self.tokenizer, self.engine.tokenizer
        if own is not None and engines is not None and own != engines:
            raise ValueError(
                f"tokenizer {own!r} differs from the engine's {engines!r}: give it once"
            )
        if own is not None:
            object.__setattr__(self, "engine", msgspec.structs.replace(self.engine, tokenizer=own))
        object.__setattr__(self, "tokenizer", self.engine.tokenizer)
        parse_pooler_override(self.pooler_config)  # a bad one is refused here, at the edge
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
