"""The scheduler's configuration, errors, statistics and step result (`_scheduler`'s
types, apart so that the scheduling policy reads alone)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ....common.speculative import SpeculativeConfig
from ....gpu import PromptLogprobs


class SchedulerConfigError(ValueError):
    """A scheduler setting is out of range; the message names it and the limit."""


class InvalidRequestError(ValueError):
    """A request can never be served as sent; the message says what to change."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits, fixed at start-up once the KV cache is sized."""

    num_blocks: int
    block_size: int
    max_num_seqs: int  # requests running at once (the runner's rows)
    max_num_batched_tokens: int  # tokens computed per step, over all requests
    max_model_len: int  # prompt plus outputs, per request
    enable_prefix_caching: bool = True
    # Distinct LoRA adapters the running requests may hold (the worker's device slots).
    max_loras: int = 1
    hidden_size: int = 0  # a prompt embedding's width (0: prompt embeddings unchecked)
    # Prompt tokens each running decode earns per step (0: no cap, prompts fill the budget).
    max_prefill_tokens_per_decode: int = 0
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise SchedulerConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_tokens_per_decode < 0:
            raise SchedulerConfigError(
                f"max_prefill_tokens_per_decode must be >= 0 (0: no cap), got "
                f"{self.max_prefill_tokens_per_decode}"
            )
        if self.max_model_len < 2:
            raise SchedulerConfigError(
                f"max_model_len must be >= 2 (a prompt token and an output), "
                f"got {self.max_model_len}"
            )
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise SchedulerConfigError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of "
                f"{self.block_size}), fewer than one request of max_model_len "
                f"{self.max_model_len}: lower max_model_len to at most {capacity} or give the "
                f"KV cache more memory"
            )


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the queues, the KV cache and the prefix cache (counters in tokens)."""

    step: int
    num_waiting: int
    num_running: int
    num_free_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Speculative decoding (`SpecDecodingStats`): rows that verified drafts, drafts, accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


@dataclass
class StepResult:
    """One step's outputs, columnar, ready for the STEP record (DESIGN.md §4).

    One row per request that produced a token (one token each), then one row without tokens
    (finish ABORT) per request aborted since the last result. Per-token columns are aligned
    with `tokens`; `prompt_logprobs` is keyed by rnum and may name requests without a row
    (a prompt chunk that sampled nothing).
    """

    step: int
    rnums: np.ndarray  # [rows] uint64
    tok_offsets: np.ndarray  # [rows + 1] uint32
    tokens: np.ndarray  # [num_tokens] int32
    finish: np.ndarray  # [rows] uint8 FinishReason
    num_cached_tokens: np.ndarray  # [rows] uint32
    logprobs: np.ndarray | None = None  # [num_tokens] float32
    topk_ids: np.ndarray | None = None  # [num_tokens, k] int32
    topk_logprobs: np.ndarray | None = None  # [num_tokens, k] float32
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # Pooling requests that finished this step: f32 [m, hidden] and each row's rnum.
    pooled_rnums: np.ndarray | None = None
    pooled: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.rnums)
