"""Per-request timings of `bench_serve.py` and the aggregate numbers computed from them.

Definitions follow `vllm bench serve`, so results compare across servers:
- TTFT: request sent -> first chunk carrying content.
- ITL: the gaps between consecutive content chunks (a chunk may carry several tokens; the gap
  is still what a reader waits for).
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than one token.
- E2EL: request sent -> end of the stream.
- goodput: completed requests per second that met every SLO given.
Percentiles are numpy's (linear interpolation), as vLLM's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    """What one request measured; `error` is empty on success."""

    prompt_len: int = 0
    expected_output_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # seconds since the benchmark started, for the timeline
    generated_text: str = ""
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error

    @property
    def tpot(self) -> float | None:
        """Decode time per token after the first; None when there is one token or none."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile, 0.0 for no values (a report must not fail on an empty series)."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p90/p99 of a series in seconds, as `<stat>_<name>_ms` keys."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(ms.mean()) if ms.size else 0.0,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": float(ms.std()) if ms.size else 0.0,
    }
    for q in PERCENTILES[1:]:
        out[f"p{q}_{name}_ms"] = percentile(ms, q)
    return out


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` into {metric: milliseconds}.

    Raises:
        ValueError: an unknown metric, a missing colon or a value that is not a positive number.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput takes METRIC:MS with METRIC in {SLO_METRICS}, not {spec!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of ms") from None
        if ms <= 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(out: RequestOutput, slos: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (a one-token request has no TPOT to miss)."""
    values = {"ttft": out.ttft, "tpot": out.tpot, "e2el": out.latency}
    return out.success and all(
        values[name] is None or values[name] * 1000.0 <= ms  # type: ignore[operator]
        for name, ms in slos.items()
    )


def compute_metrics(
    outputs: Sequence[RequestOutput], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """The aggregate report (vLLM's key names) over a run that lasted `duration_s`."""
    done = [o for o in outputs if o.success]
    tpots = [t for o in done if (t := o.tpot) is not None]
    itls = [gap for o in done for gap in o.itl]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    duration_s = max(duration_s, 1e-9)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "request_goodput": None,
    }
    if slos:
        good = sum(meets_slos(o, slos) for o in done)
        result["request_goodput"] = good / duration_s
    result |= summarize("ttft", [o.ttft for o in done])
    result |= summarize("tpot", tpots)
    result |= summarize("itl", itls)
    result |= summarize("e2el", [o.latency for o in done])
    result |= output_length_stats(done)
    return result


def output_length_stats(done: Sequence[RequestOutput]) -> dict[str, Any]:
    """How many tokens requests really produced against what they asked for."""
    lens = [o.output_tokens for o in done]
    return {
        "mean_output_len": float(np.mean(lens)) if lens else 0.0,
        "min_output_len": min(lens, default=0),
        "max_output_len": max(lens, default=0),
        "num_short_outputs": sum(o.output_tokens < o.expected_output_len for o in done),
    }


def per_request_arrays(outputs: Sequence[RequestOutput]) -> dict[str, list[Any]]:
    """vLLM's per-request arrays (in seconds, as vLLM saves them), plus start times."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "e2els": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "errors": [o.error for o in outputs],
    }
