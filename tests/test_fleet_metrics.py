"""Scraping a server's /metrics: vLLM's prefix-cache counters, KV usage, residency histograms, bounds."""

from __future__ import annotations

import pytest

from fleet.metrics import (
    BLOCK_LIFETIME,
    KV_CACHE_USAGE,
    NUM_PREEMPTIONS,
    NUM_RUNNING,
    NUM_WAITING,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    MetricsError,
    MetricsSample,
    hit_rate_between,
    parse_metrics,
    pod_metrics,
    scrape,
)
from tests.fleet_support import MetricsServer, vllm_metrics_text


@pytest.fixture
def server():
    metrics_server = MetricsServer(vllm_metrics_text(queries=1000, hits=250))
    yield metrics_server
    metrics_server.close()


def test_a_scrape_reads_the_counters_usage_and_histograms_summed_over_engines(server):
    sample = scrape(server.url)
    assert sample.counters == {PREFIX_CACHE_QUERIES: 1000, PREFIX_CACHE_HITS: 250, NUM_PREEMPTIONS: 1}
    assert sample.gauges == {KV_CACHE_USAGE: 0.5}
    lifetime = sample.histograms[BLOCK_LIFETIME]
    assert lifetime.buckets == ((1.0, 0.0), (10.0, 1.0), (100.0, 2.0), (1000.0, 2.0), (float("inf"), 2.0))
    assert (lifetime.count, lifetime.sum, lifetime.mean) == (2.0, 43.0, 21.5)
    assert len(sample.histograms) == 3


def test_the_hit_rate_is_the_difference_of_two_scrapes(server):
    before = scrape(server.url)
    server.body = vllm_metrics_text(queries=3000, hits=1250)
    after = scrape(server.url)
    window = hit_rate_between(before, after)
    assert (window.queries, window.hits, window.rate, window.counters_reset) == (2000, 1000, 0.5, False)


def test_a_counter_that_went_down_means_a_restart_and_the_window_counts_from_zero():
    before = MetricsSample(1.0, {PREFIX_CACHE_QUERIES: 900, PREFIX_CACHE_HITS: 300}, {}, {})
    after = MetricsSample(2.0, {PREFIX_CACHE_QUERIES: 100, PREFIX_CACHE_HITS: 40}, {}, {})
    window = hit_rate_between(before, after)
    assert (window.queries, window.hits, window.counters_reset) == (100, 40, True)


def test_a_window_without_queries_has_no_rate():
    sample = MetricsSample(1.0, {PREFIX_CACHE_QUERIES: 5, PREFIX_CACHE_HITS: 5}, {}, {})
    window = hit_rate_between(sample, MetricsSample(2.0, dict(sample.counters), {}, {}))
    assert not window.has_queries
    with pytest.raises(ValueError):
        _ = window.rate


def test_a_server_without_the_residency_histograms_gives_none():
    text = "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total 4\n"
    sample = parse_metrics(text, 0.0)
    assert sample.counters == {PREFIX_CACHE_QUERIES: 4} and sample.histograms == {}
    with pytest.raises(ValueError, match="prefix_cache_hits"):
        hit_rate_between(sample, sample)


def test_a_response_over_the_size_bound_is_refused(server):
    with pytest.raises(MetricsError, match="more than 100 bytes"):
        scrape(server.url, max_bytes=100)


def test_a_server_that_does_not_answer_in_time_is_refused():
    slow = MetricsServer(vllm_metrics_text(1, 1), delay_s=2.0)
    try:
        with pytest.raises(MetricsError):
            scrape(slow.url, timeout_s=0.3)
    finally:
        slow.close()


def test_an_unreachable_server_and_text_that_is_not_prometheus_are_refused(server):
    server.body = "this is { not prometheus"
    with pytest.raises(MetricsError):
        scrape(server.url)
    server.close()
    with pytest.raises(MetricsError):
        scrape(server.url, timeout_s=0.5)


def test_only_http_urls_are_scraped():
    with pytest.raises(ValueError):
        scrape("file:///etc/passwd")


def test_running_and_waiting_requests_are_summed_over_engines_and_the_capacity_read_from_cache_config_info():
    sample = parse_metrics(vllm_metrics_text(queries=10, hits=5, scheduler=True), taken_at=1.0)
    assert sample.gauges[NUM_RUNNING] == 3 and sample.gauges[NUM_WAITING] == 1
    assert sample.gauges[KV_CACHE_USAGE] == 0.5, "usage stays the mean: each engine's share of its own pool"
    assert sample.num_gpu_blocks == 2000
    record = pod_metrics("a", sample)
    assert (record.num_running, record.num_waiting, record.num_gpu_blocks, record.kv_cache_usage) == (3, 1, 2000, 0.5)
    assert (record.prefix_cache_queries, record.prefix_cache_hits, record.error) == (10, 5, None)
