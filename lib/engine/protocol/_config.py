"""The engine process's configuration and command line: parsed once at the edge (CLI, or the
frontend's `LLMConfig`), sent to the child as JSON, so both processes read one definition."""

from __future__ import annotations

import msgspec

from ...gpu import WorkerConfig
from ...transport_shm import RingAddress

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
    # Structured outputs: where the model's tokenizer is (None: the model's own), and how
    # long one grammar may take to compile before its request fails.
    tokenizer: str | None = None
    structured_outputs_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise EngineConfigError(f"executor {self.executor!r} is not one of {EXECUTORS}")
        if self.tensor_parallel_size < 1:
            raise EngineConfigError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if not self.structured_outputs_timeout > 0:
            raise EngineConfigError(
                f"structured_outputs_timeout must be > 0, got {self.structured_outputs_timeout}"
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
