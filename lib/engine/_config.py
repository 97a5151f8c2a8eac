"""Configuration: the engine process's (parsed once at the edge, sent to the child as JSON) and
the frontend's `LLMConfig`, which wraps it."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ..gpu import WorkerConfig
from ..transport_shm import RingAddress
from ._heartbeat import MIN_WATCHDOG_TIMEOUT

EXECUTORS = ("auto", "uni", "multiproc", "null")


class EngineConfigError(ValueError):
    """An engine setting is out of range; the message names it and the limit."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the engine process needs besides its ring addresses."""

    worker: WorkerConfig
    tensor_parallel_size: int = 1
    executor: str = "auto"  # auto: "uni" at TP 1, "multiproc" above
    enable_prefix_caching: bool = True
    null_step_time: float = 0.0  # the null executor's simulated step time, seconds
    null_num_blocks: int = 65536
    request_ring_bytes: int = 1 << 22
    output_ring_bytes: int = 1 << 24
    output_timeout: float = 60.0  # how long a step waits for the frontend to make room

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise EngineConfigError(f"executor {self.executor!r} is not one of {EXECUTORS}")
        if self.tensor_parallel_size < 1:
            raise EngineConfigError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.executor == "uni" and self.tensor_parallel_size > 1:
            raise EngineConfigError("the uni executor runs one rank: use executor='multiproc'")

    @property
    def executor_kind(self) -> str:
        if self.executor != "auto":
            return self.executor
        return "uni" if self.tensor_parallel_size == 1 else "multiproc"


class EngineArgs(msgspec.Struct, frozen=True):
    """The engine's command line: its config, its rings, and who its parent is."""

    config: EngineConfig
    request_ring: RingAddress
    output_ring: RingAddress
    parent_pid: int


@dataclass(frozen=True)
class LLMConfig:
    """The frontend's configuration (the engine's is inside)."""

    engine: EngineConfig
    tokenizer: str | None = None  # default: the model directory
    start_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    # Seconds without the engine's heartbeat before it is declared dead and killed (0: never).
    watchdog_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.watchdog_timeout != 0 and self.watchdog_timeout < MIN_WATCHDOG_TIMEOUT:
            raise ValueError(
                f"the engine watchdog timeout must be 0 (off) or at least "
                f"{MIN_WATCHDOG_TIMEOUT} s (the heartbeat's jitter), got {self.watchdog_timeout}"
            )
