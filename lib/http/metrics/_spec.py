"""Speculative decoding's metrics, named as vLLM's (`vllm:spec_decode_*`), and an acceptance rate.

The engine counts, cumulatively, the rows that verified drafts (`spec_num_drafts`), the
drafts they verified (`spec_num_draft_tokens`), the drafts accepted (`spec_num_accepted_
tokens`) and the accepted ones by position (`spec_accepted_per_position`, 0 the first draft),
and its `stats` utility reports them in `SchedulerStats`. As with the other engine counters,
the counters here move forward by the difference since the last reading, and a reading lower
than the last one is a new engine (a restart) counting from zero.

The counters are exposed as `trillm:*` and again as vLLM's `vllm:*` (`metrics/_vllm`), so
dashboards built for vLLM's speculative decoding read ours; `trillm:spec_decode_acceptance_
rate` (accepted over verified drafts, since the engine started) is ours alone, the figure
vLLM's log prints and its dashboards compute from the two counters.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

_ENGINE_LABELS = ("model_name", "engine")
# `SchedulerStats` key -> metric name after `trillm:spec_decode_`.
_TOTALS = (
    ("spec_num_drafts", "num_drafts", "Rows that verified speculative draft tokens."),
    ("spec_num_draft_tokens", "num_draft_tokens", "Speculative draft tokens verified."),
    ("spec_num_accepted_tokens", "num_accepted_tokens", "Speculative draft tokens accepted."),
)


class SpecDecodeMetrics:
    """The speculative decoding series of one model's registry (`Metrics` holds one)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_engines: int) -> None:
        self.model_name = model_name
        self._last: dict[tuple[int, str], int] = {}
        self.totals = {
            key: Counter(f"trillm:spec_decode_{name}", doc, _ENGINE_LABELS, registry=registry)
            for key, name, doc in _TOTALS
        }
        self.accepted_per_pos = Counter(
            "trillm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, by position in the draft (0: the first).",
            (*_ENGINE_LABELS, "position"),
            registry=registry,
        )
        self.acceptance_rate = Gauge(
            "trillm:spec_decode_acceptance_rate",
            "Speculative draft tokens accepted over those verified, since the engine started "
            "(no series before its first draft).",
            _ENGINE_LABELS,
            registry=registry,
        )
        for counter in self.totals.values():
            for engine in range(num_engines):
                counter.labels(model_name, str(engine))

    @property
    def vllm_named(self) -> tuple[Counter, ...]:
        """The counters vLLM has by the same names (exposed again as `vllm:*`)."""
        return (*self.totals.values(), self.accepted_per_pos)

    def update(self, stats: Mapping[str, object], engine: int) -> None:
        """Move the series of engine `engine` to its `stats` (`SchedulerStats` as a dict);
        missing keys leave them as they are."""
        name, index = self.model_name, str(engine)
        for key, counter in self.totals.items():
            total = stats.get(key)
            if isinstance(total, int):
                counter.labels(name, index).inc(self._advance((engine, key), total))
        per_pos = stats.get("spec_accepted_per_position")
        if isinstance(per_pos, list | tuple):
            for position, total in enumerate(per_pos):
                if isinstance(total, int):
                    child = self.accepted_per_pos.labels(name, index, str(position))
                    child.inc(self._advance((engine, f"pos{position}"), total))
        drafted, accepted = (
            stats.get("spec_num_draft_tokens"),
            stats.get("spec_num_accepted_tokens"),
        )
        if isinstance(drafted, int) and isinstance(accepted, int) and drafted > 0:
            self.acceptance_rate.labels(name, index).set(accepted / drafted)

    def _advance(self, key: tuple[int, str], total: int) -> int:
        """How far a counter moves to `total`, the engine's cumulative count (all of it when
        it is below the last: a new engine)."""
        last = self._last.get(key, 0)
        self._last[key] = total
        return total - last if total >= last else total
