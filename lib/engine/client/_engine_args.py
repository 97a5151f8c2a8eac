"""`trillm.LLM`'s keyword arguments (vLLM's "engine args"), sorted into the three configs.

Each keyword is a field of `WorkerConfig` (dtype, max_model_len, max_num_seqs, seed,
kv_cache_bytes, ...), of `EngineConfig` (tensor_parallel_size, enable_prefix_caching, ...) or
of `LLMConfig` (tokenizer, chat_template, the start, shutdown and watchdog deadlines), under
its own name; `kv_cache_memory_bytes` (vLLM's and the CLI's name) is `kv_cache_bytes`. What
only the server does (data parallelism, engine restarts, several nodes) is not offered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import msgspec

from ...common.config import WorkerConfig
from ..protocol._config import EngineConfig
from ._config import LLMConfig

_WORKER = frozenset(f.name for f in dataclasses.fields(WorkerConfig)) - {"model"}
_ENGINE = frozenset(f.name for f in msgspec.structs.fields(EngineConfig)) - {
    "worker",
    "tokenizer",  # `LLMConfig(tokenizer=...)` sets it
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "distributed_timeout",
}
_FRONTEND = frozenset(
    {"tokenizer", "chat_template", "start_timeout", "shutdown_timeout", "watchdog_timeout"}
)
_ALIASES = {"kv_cache_memory_bytes": "kv_cache_bytes"}
ENGINE_ARGS = _WORKER | _ENGINE | _FRONTEND | frozenset(_ALIASES)


def offline_config(model: str | None, engine_args: Mapping[str, object]) -> LLMConfig:
    """The configs of `LLM(model, **engine_args)`; `model` None is the built-in default.

    Raises:
        TypeError: a keyword that is no engine argument (the message lists them).
        ValueError: a value out of range (`WorkerConfigError`, `EngineConfigError`).
    """
    unknown = sorted(set(engine_args) - ENGINE_ARGS)
    if unknown:
        raise TypeError(
            f"LLM() got an unexpected engine argument {unknown[0]!r}; the engine arguments "
            f"are: {', '.join(sorted(ENGINE_ARGS))}"
        )
    args = {_ALIASES.get(name, name): value for name, value in engine_args.items()}
    if model is None:
        from ...default_model import default_model_dir

        model = str(default_model_dir())
    worker = WorkerConfig(model, **{k: v for k, v in args.items() if k in _WORKER})  # type: ignore[arg-type]
    frontend = {k: v for k, v in args.items() if k in _FRONTEND}
    engine = {k: v for k, v in args.items() if k in _ENGINE}
    engine.setdefault(
        "worker_watchdog_timeout", frontend.get("watchdog_timeout", LLMConfig.watchdog_timeout)
    )
    return LLMConfig(EngineConfig(worker=worker, **engine), **frontend)  # type: ignore[arg-type]
