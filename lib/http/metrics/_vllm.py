"""vLLM's own metric names (`vllm:x`) over trillm's (`trillm:x`), for routers and pickers.

Routers and schedulers built for vLLM read a replica's load from its /metrics under vLLM's
names: llm-d's endpoint picker (the Gateway API inference extension) reads
`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` and the
`block_size` / `num_gpu_blocks` labels of `vllm:cache_config_info`; vLLM's production-stack
router and the Grafana dashboards made for vLLM read more of the same. Each alias is a renamed
copy of the trillm family, made while the scrape renders it, so the two cannot drift: there is
no second counter to keep in step, and a scrape shows both from the same reading.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

OURS = "trillm:"
THEIRS = "vllm:"


def vllm_name(name: str) -> str:
    """`trillm:x` as vLLM names it, `vllm:x`."""
    if not name.startswith(OURS):
        raise ValueError(f"{name!r} is not a trillm metric name (it must start with {OURS!r})")
    return THEIRS + name[len(OURS) :]


class VllmAliases:
    """A collector that yields `sources` again under vLLM's names (register it once)."""

    def __init__(self, sources: Iterable[MetricWrapperBase]) -> None:
        self._sources = tuple(sources)

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                yield renamed(family)


def renamed(family: Metric) -> Metric:
    """`family` and its samples under vLLM's names; labels, values and types unchanged."""
    alias = Metric(vllm_name(family.name), family.documentation, family.type, family.unit)
    alias.samples = [s._replace(name=vllm_name(s.name)) for s in family.samples]
    return alias
