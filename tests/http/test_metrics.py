"""Metrics: the exposed names, values after a few observations, forward-only engine counters."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from trillm.http.metrics._metrics import CONTENT_TYPE, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `render()` by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


ENGINE_SOURCED = {
    "trillm:num_requests_running",
    "trillm:num_requests_waiting",
    "trillm:kv_cache_usage_perc",
    "trillm:kv_cache_free_blocks",
    "trillm:prefix_cache_queries_total",
    "trillm:prefix_cache_hits_total",
    "trillm:num_preemptions_total",
    "trillm:engine_steps_total",
}


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample's value; what the engines report is engine 0's unless `engine=` says."""
    if name in ENGINE_SOURCED:
        labels.setdefault("engine", "0")
    return samples(metrics)[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]


def test_the_exposed_names_are_vllm_s_with_our_prefix() -> None:
    names = {name for name, _ in samples(Metrics("tiny"))}
    assert {
        "trillm:time_to_first_token_seconds_count",
        "trillm:inter_token_latency_seconds_count",
        "trillm:e2e_request_latency_seconds_count",
        "trillm:request_queue_time_seconds_count",
        "trillm:num_requests_running",
        "trillm:num_requests_waiting",
        "trillm:kv_cache_usage_perc",
        "trillm:prefix_cache_queries_total",
        "trillm:prefix_cache_hits_total",
        "trillm:prompt_tokens_total",
        "trillm:generation_tokens_total",
        "trillm:request_success_total",
    } <= names
    assert not any(name.endswith("_total_total") for name in names)
    text = Metrics("tiny").render().decode()
    assert "# TYPE trillm:prompt_tokens_total counter" in text
    assert "# TYPE trillm:time_to_first_token_seconds histogram" in text
    assert CONTENT_TYPE.startswith("text/plain")


def test_every_series_is_labelled_with_the_model_and_starts_at_zero() -> None:
    metrics = Metrics("tiny")
    for (name, labels), v in samples(metrics).items():
        if not name.endswith("_created"):
            assert ("model_name", "tiny") in labels, name
            assert v == 0, name
    assert value(metrics, "trillm:request_success_total", finished_reason="abort") == 0


def test_observe_request() -> None:
    metrics = Metrics("tiny")
    metrics.observe_request(0.05, [0.02, 0.03], 1.2, 10, 3, "stop", queue_time=0.01)
    metrics.observe_request(None, [], 0.4, 5, 0, "abort")
    assert value(metrics, "trillm:time_to_first_token_seconds_count") == 1
    assert value(metrics, "trillm:time_to_first_token_seconds_sum") == 0.05
    assert value(metrics, "trillm:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value(metrics, "trillm:time_to_first_token_seconds_bucket", le="0.04") == 0
    assert value(metrics, "trillm:inter_token_latency_seconds_count") == 2
    assert value(metrics, "trillm:inter_token_latency_seconds_sum") == 0.05
    assert value(metrics, "trillm:e2e_request_latency_seconds_count") == 2
    assert value(metrics, "trillm:request_queue_time_seconds_count") == 1
    assert value(metrics, "trillm:prompt_tokens_total") == 15
    assert value(metrics, "trillm:generation_tokens_total") == 3
    assert value(metrics, "trillm:request_success_total", finished_reason="stop") == 1
    assert value(metrics, "trillm:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "trillm:request_success_total", finished_reason="length") == 0


def test_engine_stats_set_gauges_and_move_counters_forward() -> None:
    metrics = Metrics("tiny")
    stats = {
        "num_running": 3,
        "num_waiting": 1,
        "kv_usage": 0.25,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
    }
    metrics.set_engine_stats(stats)
    metrics.set_engine_stats({**stats, "num_running": 2, "prefix_cache_queries": 150})
    assert value(metrics, "trillm:num_requests_running") == 2
    assert value(metrics, "trillm:num_requests_waiting") == 1
    assert value(metrics, "trillm:kv_cache_usage_perc") == 0.25
    assert value(metrics, "trillm:prefix_cache_queries_total") == 150
    assert value(metrics, "trillm:prefix_cache_hits_total") == 40
    # A lower count is a new engine: its count adds on, the counter never goes back.
    metrics.set_engine_stats({"prefix_cache_queries": 20})
    assert value(metrics, "trillm:prefix_cache_queries_total") == 170
    assert value(metrics, "trillm:num_requests_running") == 2


def test_each_data_parallel_engine_has_its_own_series() -> None:
    metrics = Metrics("tiny", num_engines=2)
    assert value(metrics, "trillm:num_requests_running", engine="1") == 0  # there from the start
    metrics.set_engine_stats({"num_running": 3, "prefix_cache_queries": 10}, engine=0)
    metrics.set_engine_stats({"num_running": 5, "prefix_cache_queries": 7}, engine=1)
    metrics.set_engine_stats({"prefix_cache_queries": 12}, engine=0)  # not engine 1's count
    assert value(metrics, "trillm:num_requests_running", engine="1") == 5
    assert value(metrics, "trillm:prefix_cache_queries_total", engine="0") == 12
    assert value(metrics, "trillm:prefix_cache_queries_total", engine="1") == 7
    metrics.engine_gone(1)
    assert value(metrics, "trillm:num_requests_running", engine="1") == 0
    assert value(metrics, "trillm:prefix_cache_queries_total", engine="1") == 7


def test_two_servers_in_one_process_have_their_own_registries() -> None:
    a, b = Metrics("tiny"), Metrics("tiny")
    a.observe_request(0.1, [], 0.2, 4, 1, "length")
    assert value(a, "trillm:prompt_tokens_total") == 4
    assert value(b, "trillm:prompt_tokens_total") == 0
