"""The engine process's configuration and command line: parsed once at the edge (CLI, or the
frontend's `LLMConfig`), sent to the child as JSON, so both processes read one definition."""

from __future__ import annotations

import msgspec

from ...common.config import WorkerConfig
from ...common.flags import Flag, Option, options_of
from ...common.wire import LoraModule, parse_lora_module
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
    # Schedule step N+1 while N runs (`engine.core._async_scheduler`); off: each step is
    # scheduled after the last one's tokens are read.
    async_scheduling: bool = False
    null_step_time: float = 0.0  # the null executor's simulated step time, seconds
    null_num_blocks: int = 65536
    request_ring_bytes: int = 1 << 22
    output_ring_bytes: int = 1 << 24
    output_timeout: float = 60.0  # how long a step waits for the frontend to make room
    # Structured outputs: where the model's tokenizer is (None: the model's own; the one
    # owner of the setting: `LLMConfig.tokenizer` reads it), and how long one grammar may
    # take to compile before its request fails.
    tokenizer: str | None = None
    structured_outputs_timeout: float = 10.0
    # Seconds without a worker rank's heartbeat before it is declared not responding and
    # killed (TP > 1; 0: never); the server sets it to --engine-watchdog-timeout.
    worker_watchdog_timeout: float = 0.0
    # Threads for the model's CPU kernels in the engine process (TP 1; 0: torch's default,
    # every core). Data-parallel engines on one CPU split the cores: N engines of torch's
    # default oversubscribe them (perf/dp_bench.py: 0.25x one engine on 2 cores).
    cpu_threads: int = 0
    # Tensor parallelism across nodes (vLLM's flags): node 0 runs the engine and ranks
    # 0..L-1 (L = tensor_parallel_size / nnodes); node k > 0 runs a headless node agent with
    # ranks kL..kL+L-1. torch.distributed meets at master_addr:master_port; the executor's
    # broadcast listener at master_addr:master_port + 1. master_port None: a free port
    # (nnodes 1 only).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_timeout: float = 120.0  # seconds for every node to join
    # The node link without a node token (anyone who reaches it can join). The token itself
    # is no field: this config travels on the engine's command line, which every user can
    # read; the frontend hands it over in TRILLM_NODE_TOKEN (engine.core._node_link).
    insecure_node_link: bool = False
    # Which of the frontend's data-parallel engines this is (None: the only one); it names
    # the process (`trillm::engine_<i>`) and its profiler traces.
    data_parallel_rank: int | None = None
    # LoRA adapters loaded at start-up (`--lora-modules`; ids 0 are numbered by position,
    # `numbered`); a bad one fails the start, naming it. Needs `worker.enable_lora`.
    lora_modules: tuple[LoraModule, ...] = ()

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
        if self.lora_modules and not self.worker.enable_lora:
            raise EngineConfigError("--lora-modules needs --enable-lora")
        if self.executor == "uni" and self.tensor_parallel_size > 1:
            raise EngineConfigError("the uni executor runs one rank: use executor='multiproc'")
        self._check_nodes()

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise EngineConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise EngineConfigError(
                f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), "
                f"got {self.node_rank}"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise EngineConfigError(
                f"--tensor-parallel-size {self.tensor_parallel_size} is not divisible by "
                f"--nnodes {self.nnodes}: every node runs the same number of ranks"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise EngineConfigError(
                f"--master-port is required with --nnodes {self.nnodes}: every node must be "
                f"given the same one (port+1 is used too)"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65534:
            raise EngineConfigError(f"--master-port must be in 1..65534, got {self.master_port}")
        if not self.distributed_timeout > 0:
            raise EngineConfigError(
                f"--distributed-timeout must be > 0 seconds, got {self.distributed_timeout}"
            )
        if self.nnodes > 1 and self.executor not in ("auto", "multiproc"):
            raise EngineConfigError(
                f"--nnodes {self.nnodes} needs the multiproc executor, got {self.executor!r}"
            )

    @classmethod
    def options(cls) -> list[Option]:
        """The `trillm serve` flags of the fields (`ENGINE_FLAGS`)."""
        return options_of(cls, ENGINE_FLAGS)

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def executor_kind(self) -> str:
        if self.executor != "auto":
            return self.executor
        return "uni" if self.tensor_parallel_size == 1 and self.nnodes == 1 else "multiproc"


# The `trillm serve` flags of `EngineConfig`'s fields (a Struct's fields carry no metadata;
# `trillm.common.flags.Flag`). The server sets `worker_watchdog_timeout` from
# `LLMConfig.watchdog_timeout` (--engine-watchdog-timeout).
ENGINE_FLAGS = {
    "tensor_parallel_size": Flag(("--tensor-parallel-size", "-tp")),
    "nnodes": Flag(("--nnodes",), "machines in the TP group"),
    "node_rank": Flag(("--node-rank",), "this machine's index (0: server)"),
    "master_addr": Flag(("--master-addr",), "node 0's address"),
    "master_port": Flag(
        ("--master-port",),
        "node 0's port for torch.distributed (and +1 for the step broadcast); required with "
        "--nnodes > 1 (default: a free port)",
    ),
    "insecure_node_link": Flag(
        ("--insecure-node-link",),
        "let nodes join without a node token: anyone who reaches --master-port + 1 can then "
        "join as a node and read every prompt (only on a network that no one else reaches)",
    ),
    "distributed_timeout": Flag(
        ("--distributed-timeout",), "seconds for every node to join before start-up fails"
    ),
    "enable_prefix_caching": Flag(("--enable-prefix-caching",)),
    "async_scheduling": Flag(
        ("--async-scheduling",),
        "schedule each step while the last one runs, its tokens read a step later (steps "
        "with grammars, penalties, min_tokens, prompt logprobs, pooling or speculative "
        "decoding stay synchronous)",
    ),
    "lora_modules": Flag(
        ("--lora-modules",),
        "LoRA adapters to serve, each name=path (a PEFT directory) or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; requests name one as model',
        metavar="SPEC",
        many=True,
        parse=parse_lora_module,
    ),
    "executor": Flag(
        ("--executor",),
        "null: no model, deterministic tokens (for host-overhead benchmarks)",
        choices=EXECUTORS,
    ),
    "null_step_time": Flag(("--null-step-time",), "the null executor's step time, s"),
    "structured_outputs_timeout": Flag(
        ("--structured-outputs-timeout",),
        "seconds a grammar (JSON schema, regex, tools) may take to compile; past it only that "
        "request fails (400)",
    ),
}


class EngineArgs(msgspec.Struct, frozen=True):
    """The engine's command line: its config, its rings, and who its parent is."""

    config: EngineConfig
    request_ring: RingAddress
    output_ring: RingAddress
    parent_pid: int
