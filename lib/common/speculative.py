"""`--speculative-config`: speculative decoding's settings, named as vLLM names them.

Two methods propose draft tokens that the target model then verifies in one step:

- `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
  "prompt_lookup_max": b}`: prompt lookup. The longest suffix of the sequence (b tokens down
  to a) that occurred before proposes the k tokens that followed it. No model, no memory.
- `{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`: a smaller model
  with the target's tokenizer, run by the same worker over its own KV cache, proposes k
  tokens greedily.

`disable_by_batch_size` (both): no speculation in a step where more requests run or wait
than this (vLLM counts the requests enqueued; a queue means the engine is at capacity, and
drafts would spend compute the queued requests wait for). On a CPU a step's cost grows with
its tokens once the batch is large (the products turn compute-bound), so verifying k + 1
tokens per sequence slows a full batch down unless most are accepted; at a small batch the
weights' read dominates and the extra tokens cost little (the figures below).

Parsed once at the edge (the CLI, `LLMConfig`), carried as its JSON text inside
`WorkerConfig` (the worker runs the proposer, the engine schedules the drafts). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

METHODS = ("ngram", "draft_model")
# The default `disable_by_batch_size`, a judgement from measured step costs, not a measured
# optimum. On the default model (float32, one thread, `perf/spec_bench.py --verify`) a C step
# of M rows took 47 / 54 / 76 / 118 / 166 ms at M = 5 / 10 / 20 / 40 / 60, so verifying k = 4
# drafts for r rows (M = 5r) costs about 2.3x a plain decode of them at r = 8 and 2.8x at
# r = 12 (a decode's M = r read off the same curve). The copy workload emits 3.0 tokens a
# row per verify step (acceptance 0.81): it breaks even near 12 rows, text that accepts half
# as much near 6; 8 lies between. The serving sweep (`--sweep`, perf/README.md: one run each)
# found always speculating on the copy workload 2.5x at c=1 and only 1.03x to 1.10x at c=4 to
# 32: little to lose there and little to gain; text that accepts less would lose sooner (by
# the step costs above; not served here).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
MAX_SPECULATIVE_TOKENS = 16
_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
)


class SpeculativeConfigError(ValueError):
    """`--speculative-config` is not valid; the message names the field and what to send."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative decoding settings (see the module's docstring)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0  # ngram only
    model: str | None = None  # draft_model only: a model directory or GGUF file
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def is_ngram(self) -> bool:
        return self.method == "ngram"

    def speculates(self, num_requests: int) -> bool:
        """Whether a step with `num_requests` requests running or waiting proposes drafts."""
        return num_requests <= self.disable_by_batch_size


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """`--speculative-config`'s JSON as a `SpeculativeConfig` (None for no flag or "").

    Raises:
        SpeculativeConfigError: not a JSON object, an unknown field, a missing or
            out-of-range one; the message names it.
    """
    if not text:
        return None
    try:
        raw: Any = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise SpeculativeConfigError(
            f"--speculative-config is not JSON ({exc}): send an object such as "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\''
        ) from None
    if not isinstance(raw, dict):
        raise SpeculativeConfigError(
            f"--speculative-config must be a JSON object, got {type(raw).__name__}"
        )
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise SpeculativeConfigError(
            f"--speculative-config has unknown field {unknown[0]!r}; the fields are "
            f"{', '.join(_FIELDS)}"
        )
    method = raw.get("method")
    if method not in METHODS:
        raise SpeculativeConfigError(
            f"--speculative-config method must be one of {', '.join(METHODS)}, got {method!r}"
        )
    k = _integer(raw, "num_speculative_tokens", None)
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(
            f"--speculative-config num_speculative_tokens must be in [1, "
            f"{MAX_SPECULATIVE_TOKENS}], got {k}"
        )
    disable = _integer(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if disable < 1:
        raise SpeculativeConfigError(
            f"--speculative-config disable_by_batch_size must be >= 1, got {disable}"
        )
    if method == "ngram":
        return _ngram(raw, k, disable)
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if name in raw:
            raise SpeculativeConfigError(
                f"--speculative-config {name} applies to method ngram, not {method}"
            )
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise SpeculativeConfigError(
            "--speculative-config model is required for method draft_model: the path of a "
            "smaller model with the same tokenizer"
        )
    return SpeculativeConfig(method, k, model=model, disable_by_batch_size=disable)


def _ngram(raw: dict[str, Any], k: int, disable: int) -> SpeculativeConfig:
    """vLLM's defaults: both bounds 5 when neither is given, else the one given for both."""
    if "model" in raw:
        raise SpeculativeConfigError(
            "--speculative-config model applies to method draft_model, not ngram"
        )
    low = _integer(raw, "prompt_lookup_min", 0)
    high = _integer(raw, "prompt_lookup_max", 0)
    if not low and not high:
        low = high = 5
    low, high = low or high, high or low
    if low < 1:
        raise SpeculativeConfigError(
            f"--speculative-config prompt_lookup_min must be >= 1, got {low}"
        )
    if high < low:
        raise SpeculativeConfigError(
            f"--speculative-config prompt_lookup_max ({high}) must be >= prompt_lookup_min ({low})"
        )
    return SpeculativeConfig("ngram", k, low, high, disable_by_batch_size=disable)


def _integer(raw: dict[str, Any], name: str, default: int | None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise SpeculativeConfigError(f"--speculative-config {name} is required")
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpeculativeConfigError(
            f"--speculative-config {name} must be an integer, got {value!r}"
        )
    return value
