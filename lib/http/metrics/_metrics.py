"""Prometheus metrics of the server, named as vLLM's (`vllm:` becomes `trillm:`).

The vLLM-named ones are exposed a second time, always, under vLLM's own prefix
(`vllm:num_requests_waiting` and the rest, `metrics/_vllm.py`): routers and endpoint pickers
built for vLLM read a replica's load under those names. The aliases are renamed at scrape time
from the same children, so both names always show the same values (docs/deploy.md).

The metrics live in a registry of their own, not prometheus_client's global one, so two
servers in one process (tests) never collide and `/metrics` shows nothing else. Counters are
created without the `_total` suffix, which prometheus_client appends on exposure:
`trillm:prompt_tokens` is scraped as `trillm:prompt_tokens_total`, as vLLM's are.

Per-request figures come from the frontend (`observe_request`); queue and cache figures come
from the engine's `stats` utility (`set_engine_stats`), whose prefix-cache counters are
cumulative in the engine: we add the difference since the last call. The frontend's own
request state (`set_frontend_state`) is exposed too, so a leak of an aborted request shows on
either side of the ring (the reliability cases check both after thousands of disconnects).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from ._spec import SpecDecodeMetrics
from ._vllm import VllmAliases

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
FINISHED_REASONS = ("stop", "length", "abort", "error")
POOLING_ENDPOINTS = ("embedding", "pooling", "score", "rerank")  # `observe_pooling`

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)

_LABELS = ("model_name",)
# What the engines report carries their index too, as vLLM's metrics do (`engine="0"`).
_ENGINE_LABELS = ("model_name", "engine")


class Metrics:
    """The server's metrics for one model; `render()` is the body of `/metrics`."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        """`num_engines`: the data-parallel engines whose stats `set_engine_stats` takes."""
        self.num_engines = num_engines
        self.registry = CollectorRegistry(auto_describe=True)
        self.content_type = CONTENT_TYPE
        self.model_name = model_name
        self._last_engine_counters: dict[tuple[int, str], int] = {}
        r = self.registry

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=r, buckets=tuple(buckets))

        self.time_to_first_token = histogram(
            "trillm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "trillm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "trillm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "trillm:request_queue_time_seconds",
            "Time requests spent waiting to be scheduled, in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.num_requests_running = Gauge(
            "trillm:num_requests_running", "Requests being generated.", _ENGINE_LABELS, registry=r
        )
        self.num_requests_waiting = Gauge(
            "trillm:num_requests_waiting",
            "Requests waiting to be scheduled.",
            _ENGINE_LABELS,
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "trillm:kv_cache_usage_perc",
            "KV-cache usage; 1 means 100 percent.",
            _ENGINE_LABELS,
            registry=r,
        )
        self.kv_cache_free_blocks = Gauge(
            "trillm:kv_cache_free_blocks",
            "KV-cache blocks no request holds (cached prefix blocks included).",
            _ENGINE_LABELS,
            registry=r,
        )
        self.http_requests_in_flight = Gauge(
            "trillm:http_requests_in_flight",
            "Generation requests admitted by the HTTP server and not yet answered.",
            _LABELS,
            registry=r,
        )
        self.frontend_request_states = Gauge(
            "trillm:frontend_request_states",
            "Per-choice request states the frontend holds (unfinished requests).",
            _LABELS,
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "trillm:prefix_cache_queries",
            "Prefix-cache queries, in tokens.",
            _ENGINE_LABELS,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "trillm:prefix_cache_hits", "Prefix-cache hits, in tokens.", _ENGINE_LABELS, registry=r
        )
        self.prompt_tokens = Counter(
            "trillm:prompt_tokens", "Prefill tokens processed.", _LABELS, registry=r
        )
        self.num_preemptions = Counter(
            "trillm:num_preemptions",
            "Requests preempted (their blocks freed, recomputed later).",
            _ENGINE_LABELS,
            registry=r,
        )
        self.engine_restarts = Counter(
            "trillm:engine_restarts",
            "Times a dead engine was started again (--max-engine-restarts).",
            _LABELS,
            registry=r,
        )
        self.engine_steps = Counter(
            "trillm:engine_steps",
            "Engine steps (scheduler iterations) run.",
            _ENGINE_LABELS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "trillm:generation_tokens", "Generation tokens produced.", _LABELS, registry=r
        )
        self.request_success = Counter(
            "trillm:request_success",
            "Finished requests, by finish reason.",
            (*_LABELS, "finished_reason"),
            registry=r,
        )
        # Pooling requests (embeddings, scores) apart from generation: they make no tokens.
        self.pooling_requests = Counter(
            "trillm:pooling_requests",
            "Finished pooling requests (one per input), by endpoint; not counted in "
            "request_success.",
            (*_LABELS, "endpoint"),
            registry=r,
        )
        self.pooling_prompt_tokens = Counter(
            "trillm:pooling_prompt_tokens",
            "Prompt tokens of pooling requests (not counted in prompt_tokens).",
            _LABELS,
            registry=r,
        )
        # vLLM's info gauge (value 1), read by llm-d's endpoint picker for the block size and
        # the KV cache's size; no series until the server knows them (`set_cache_config`).
        self.cache_config = Gauge(
            "trillm:cache_config_info",
            "The KV cache's configuration.",
            (*_LABELS, "block_size", "num_gpu_blocks"),
            registry=r,
        )
        self.kernel = Info(
            "trillm:kernel",
            "The kernels the model runs with: device, dtype, linear path, CPU/GPU features.",
            _LABELS,
            registry=r,
        )
        # Children made now, so every series is scraped (at zero) before its first event.
        for metric in self._per_model:
            metric.labels(model_name)
        for metric in self._per_engine:
            for engine in range(num_engines):
                metric.labels(model_name, str(engine))
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for endpoint in POOLING_ENDPOINTS:
            self.pooling_requests.labels(model_name, endpoint)
        self.pooling_prompt_tokens.labels(model_name)
        self.spec_decode = SpecDecodeMetrics(r, model_name, num_engines)  # `metrics/_spec`
        r.register(VllmAliases((*self._vllm_named, *self.spec_decode.vllm_named)))

    @property
    def _per_model(self) -> tuple[Histogram | Gauge | Counter, ...]:
        return (
            self.time_to_first_token,
            self.inter_token_latency,
            self.e2e_request_latency,
            self.request_queue_time,
            self.http_requests_in_flight,
            self.frontend_request_states,
            self.engine_restarts,
            self.prompt_tokens,
            self.generation_tokens,
        )

    @property
    def _per_engine(self) -> tuple[Gauge | Counter, ...]:
        return (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage,
            self.kv_cache_free_blocks,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions,
            self.engine_steps,
        )

    @property
    def _vllm_named(self) -> tuple[Histogram | Gauge | Counter, ...]:
        """Ours that vLLM has too, by the same name: exposed again as `vllm:*`."""
        return (
            self.time_to_first_token,
            self.inter_token_latency,
            self.e2e_request_latency,
            self.request_queue_time,
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.prompt_tokens,
            self.generation_tokens,
            self.request_success,
            self.num_preemptions,
            self.cache_config,
        )

    def observe_request(
        self,
        ttft: float | None,
        itl_list: Iterable[float],
        e2e: float,
        prompt_tokens: int,
        generation_tokens: int,
        finished_reason: str,
        *,
        queue_time: float | None = None,
    ) -> None:
        """Record one finished request.

        Args:
            ttft: seconds from arrival to the first output token; None if none came (aborted).
            itl_list: seconds between consecutive output tokens.
            e2e: seconds from arrival to the end.
            prompt_tokens: prompt tokens (times n when the prompt was run n times).
            generation_tokens: output tokens over all choices.
            finished_reason: "stop", "length", "abort" or "error".
            queue_time: seconds waiting before the first schedule, when known.
        """
        name = self.model_name
        if ttft is not None:
            self.time_to_first_token.labels(name).observe(ttft)
        itl = self.inter_token_latency.labels(name)
        for seconds in itl_list:
            itl.observe(seconds)
        self.e2e_request_latency.labels(name).observe(e2e)
        if queue_time is not None:
            self.request_queue_time.labels(name).observe(queue_time)
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(generation_tokens)
        self.request_success.labels(name, finished_reason).inc()

    def observe_pooling(self, endpoint: str, requests: int, prompt_tokens: int) -> None:
        """Count `requests` finished pooling requests of `endpoint` (one of
        `POOLING_ENDPOINTS`) and their prompt tokens."""
        self.pooling_requests.labels(self.model_name, endpoint).inc(requests)
        self.pooling_prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def count_aborted(self, choices: int) -> None:
        """Count choices that ended without finishing (the client went away, or an error)."""
        if choices > 0:
            self.request_success.labels(self.model_name, "abort").inc(choices)

    def set_kernels(self, kernels: Mapping[str, str]) -> None:
        """Expose the engine's kernel choice as `trillm:kernel_info{device=..., ...} 1`."""
        self.kernel.labels(self.model_name).info(dict(kernels))

    def set_cache_config(self, *, block_size: int, num_gpu_blocks: int) -> None:
        """Expose the KV cache's shape as `trillm:cache_config_info{block_size=...,
        num_gpu_blocks=...} 1` (and `vllm:cache_config_info`), as vLLM does."""
        self.cache_config.clear()
        self.cache_config.labels(self.model_name, str(block_size), str(num_gpu_blocks)).set(1)

    def set_engine_stats(self, stats: Mapping[str, object], engine: int = 0) -> None:
        """Update engine `engine`'s series from its `stats` utility (`SchedulerStats` as a dict).

        Keys used: num_running, num_waiting, kv_usage (a fraction), num_free_blocks, and the
        engine's cumulative counts prefix_cache_queries, prefix_cache_hits (tokens), step and
        num_preemptions (a count lower than the last one means a new engine, counted from
        zero), and speculative decoding's spec_* counts (`SpecDecodeMetrics`). Missing keys
        leave their metric as it is.
        """
        name, index = self.model_name, str(engine)
        for key, gauge in (
            ("num_running", self.num_requests_running),
            ("num_waiting", self.num_requests_waiting),
            ("kv_usage", self.kv_cache_usage),
            ("num_free_blocks", self.kv_cache_free_blocks),
        ):
            value = stats.get(key)
            if isinstance(value, int | float):
                gauge.labels(name, index).set(value)
        for key, counter in (
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
            ("step", self.engine_steps),
            ("num_preemptions", self.num_preemptions),
        ):
            total = stats.get(key)
            if not isinstance(total, int):
                continue
            last = self._last_engine_counters.get((engine, key), 0)
            counter.labels(name, index).inc(total - last if total >= last else total)
            self._last_engine_counters[(engine, key)] = total
        self.spec_decode.update(stats, engine)

    def engine_gone(self, engine: int) -> None:
        """A dead engine holds no request: its load gauges read 0 (its counters stay)."""
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage):
            gauge.labels(self.model_name, str(engine)).set(0)

    def set_engine_restarts(self, total: int) -> None:
        """The frontend's count of engine restarts (cumulative; the counter follows it)."""
        child = self.engine_restarts.labels(self.model_name)
        child.inc(max(0, total - int(child._value.get())))

    def set_frontend_state(self, *, in_flight: int, request_states: int) -> None:
        """Update the frontend's gauges: HTTP generation requests in flight, and the
        per-choice states `AsyncLLM` holds (both 0 when idle, whatever went before)."""
        name = self.model_name
        self.http_requests_in_flight.labels(name).set(in_flight)
        self.frontend_request_states.labels(name).set(request_states)

    def render(self) -> bytes:
        """The exposition text of every metric (serve with `CONTENT_TYPE`)."""
        return prometheus_client.generate_latest(self.registry)
