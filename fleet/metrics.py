"""A server's Prometheus metrics: the prefix-cache counters, KV usage and the block residency histograms.

vLLM exposes them at `/metrics` (Prometheus text), one series per engine (labels `model_name`,
`engine`). `scrape` reads at most `max_bytes` within `timeout_s` and parses with prometheus_client's
parser; `MetricsSample` keeps the values this console uses, summed over the series (KV usage is the
mean over engines, each engine's usage being a fraction of its own pool); `pod_metrics` reduces one
to the `fleet.events.PodMetrics` record the sinks keep. The counters are
cumulative, so a hit rate is a difference of two samples: `hit_rate_between`.

    vllm:prefix_cache_queries   tokens looked up in the prefix cache      counter
    vllm:prefix_cache_hits      of which found cached                      counter
    vllm:num_preemptions        requests preempted                         counter
    vllm:kv_cache_usage_perc    fraction of KV blocks in use, 0..1         gauge
    vllm:num_requests_running   requests running now                       gauge
    vllm:num_requests_waiting   requests waiting now                       gauge
    vllm:cache_config_info      label num_gpu_blocks: the pool's capacity  info (a gauge at 1)
    vllm:kv_block_lifetime_seconds           allocation -> eviction        histogram
    vllm:kv_block_idle_before_evict_seconds  last access -> eviction       histogram
    vllm:kv_block_reuse_gap_seconds          between accesses of a block   histogram

The histograms exist only when the server runs with `--kv-cache-metrics`; a missing metric is simply
absent from the sample.
"""

from __future__ import annotations

import enum
import math
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from fleet.events import PodMetrics

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
NUM_RUNNING = "vllm:num_requests_running"
NUM_WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
BLOCK_LIFETIME = "vllm:kv_block_lifetime_seconds"
BLOCK_IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
BLOCK_REUSE_GAP = "vllm:kv_block_reuse_gap_seconds"

COUNTERS = (PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, NUM_PREEMPTIONS)
GAUGES = (KV_CACHE_USAGE, NUM_RUNNING, NUM_WAITING)
HISTOGRAMS = (BLOCK_LIFETIME, BLOCK_IDLE_BEFORE_EVICT, BLOCK_REUSE_GAP)


class _Part(enum.Enum):
    """What a sample is of its metric."""

    COUNTER = "counter"  # a counter's value (exposed as NAME_total, or NAME)
    GAUGE = "gauge"  # a gauge's value
    BUCKET = "bucket"  # a histogram's cumulative bucket (label le)
    COUNT = "count"  # a histogram's observation count
    SUM = "sum"  # a histogram's observation total


_SAMPLE_PARTS: dict[str, tuple[_Part, str]] = {  # sample name -> (its part, the metric)
    **{name + suffix: (_Part.COUNTER, name) for name in COUNTERS for suffix in ("", "_total")},
    **{name: (_Part.GAUGE, name) for name in GAUGES},
    **{name + "_bucket": (_Part.BUCKET, name) for name in HISTOGRAMS},
    **{name + "_count": (_Part.COUNT, name) for name in HISTOGRAMS},
    **{name + "_sum": (_Part.SUM, name) for name in HISTOGRAMS},
}

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_TIMEOUT_S = 2.0
_READ_BYTES = 64 * 1024


class MetricsError(RuntimeError):
    """A scrape that failed: unreachable, too slow, too large, or not Prometheus text."""


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram, summed over series."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound, observations <= it), ascending, last +Inf
    count: float  # observations
    sum: float  # their total

    @property
    def mean(self) -> float:
        """The mean observation.

        Raises:
            ValueError: the histogram has no observations.
        """
        if not self.count:
            raise ValueError("a histogram with no observations has no mean")
        return self.sum / self.count


@dataclass(frozen=True)
class MetricsSample:
    """The metrics of one scrape."""

    taken_at: float  # wall clock of the scrape (seconds since the epoch)
    counters: Mapping[str, float]  # COUNTERS present, summed over series
    gauges: Mapping[str, float]  # GAUGES present, mean over series
    histograms: Mapping[str, Histogram]  # HISTOGRAMS present, summed over series
    num_gpu_blocks: int | None = None  # the KV pool's capacity in blocks, summed over engines (cache_config_info)


@dataclass(frozen=True)
class HitRateWindow:
    """Prefix-cache lookups between two samples, in tokens."""

    seconds: float  # between the samples
    queries: float  # tokens looked up
    hits: float  # tokens found cached
    counters_reset: bool  # a counter went down (restarted server): the window counts from zero

    @property
    def has_queries(self) -> bool:
        """Whether anything was looked up (a rate exists)."""
        return self.queries > 0

    @property
    def rate(self) -> float:
        """hits / queries.

        Raises:
            ValueError: no queries in the window (check has_queries first).
        """
        if not self.has_queries:
            raise ValueError("no prefix-cache queries in the window")
        return self.hits / self.queries


def parse_metrics(text: str, taken_at: float) -> MetricsSample:
    """Read the metrics this console uses out of Prometheus text.

    Raises:
        MetricsError: the text is not Prometheus exposition format.
    """
    counters: dict[str, float] = {}
    gauge_values: dict[str, list[float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    capacity: int | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:  # matched by sample name: text without TYPE lines works too
                if sample.name == CACHE_CONFIG_INFO and sample.labels.get("num_gpu_blocks", "").isdigit():
                    capacity = (capacity or 0) + int(sample.labels["num_gpu_blocks"])
                    continue
                found = _SAMPLE_PARTS.get(sample.name)
                if found is None:
                    continue
                part, name = found
                if part is _Part.COUNTER:
                    counters[name] = counters.get(name, 0.0) + sample.value
                elif part is _Part.GAUGE:
                    gauge_values.setdefault(name, []).append(sample.value)
                elif part is _Part.BUCKET:
                    bound = float(sample.labels["le"])
                    by_bound = buckets.setdefault(name, {})
                    by_bound[bound] = by_bound.get(bound, 0.0) + sample.value
                elif part is _Part.COUNT:
                    counts[name] = counts.get(name, 0.0) + sample.value
                else:
                    sums[name] = sums.get(name, 0.0) + sample.value
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise MetricsError(f"not Prometheus text: {error}") from None
    histograms = {
        name: Histogram(tuple(sorted(by_bound.items())), counts.get(name, 0.0), sums.get(name, 0.0))
        for name, by_bound in buckets.items()
    }
    # Gauges sum over engines but for KV usage, each engine's usage being a fraction of its own pool.
    gauges = {
        name: sum(values) / len(values) if name == KV_CACHE_USAGE else sum(values)
        for name, values in gauge_values.items()
    }
    return MetricsSample(taken_at, counters, gauges, histograms, capacity)


def scrape(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES) -> MetricsSample:
    """GET a /metrics endpoint and parse it.

    Args:
        url: http(s)://HOST:PORT/metrics.
        timeout_s: for the whole scrape (and for connecting).
        max_bytes: a larger response is refused.

    Raises:
        ValueError: the URL is not http(s) or the bounds are not positive.
        MetricsError: unreachable, an HTTP error, too slow, too large, or not Prometheus text.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"metrics URL {url!r}: an http(s) URL with a host")
    if not timeout_s > 0 or max_bytes < 1:
        raise ValueError("timeout_s and max_bytes must be positive")
    taken_at = time.time()
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    chunks: list[bytes] = []
    size = 0
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            while chunk := response.read1(_READ_BYTES):
                size += len(chunk)
                if size > max_bytes:
                    raise MetricsError(f"scraping {url}: more than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise MetricsError(f"scraping {url}: slower than {timeout_s} s")
                chunks.append(chunk)
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        raise MetricsError(f"scraping {url}: {error}") from None
    body = b"".join(chunks)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MetricsError(f"scraping {url}: not UTF-8 ({error})") from None
    return parse_metrics(text, taken_at)


def hit_rate_between(before: MetricsSample, after: MetricsSample) -> HitRateWindow:
    """The prefix-cache lookups and hits between two samples of one server.

    A counter that went down means the server restarted: the window then counts from zero (what the
    later sample says), and `counters_reset` is set.

    Raises:
        ValueError: `after` was taken before `before`, or a sample lacks the prefix-cache counters.
    """
    if after.taken_at < before.taken_at:
        raise ValueError("the samples are out of order")
    for sample in (before, after):
        for name in (PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS):
            if name not in sample.counters or not math.isfinite(sample.counters[name]):
                raise ValueError(f"a sample without {name}")
    queries = after.counters[PREFIX_CACHE_QUERIES] - before.counters[PREFIX_CACHE_QUERIES]
    hits = after.counters[PREFIX_CACHE_HITS] - before.counters[PREFIX_CACHE_HITS]
    reset = queries < 0 or hits < 0
    if reset:
        queries, hits = after.counters[PREFIX_CACHE_QUERIES], after.counters[PREFIX_CACHE_HITS]
    return HitRateWindow(after.taken_at - before.taken_at, queries, hits, reset)


def pod_metrics(pod: str, sample: MetricsSample) -> PodMetrics:
    """The record the collector hands its sinks for one scrape."""
    return PodMetrics(
        pod=pod,
        at=sample.taken_at,
        prefix_cache_queries=sample.counters.get(PREFIX_CACHE_QUERIES),
        prefix_cache_hits=sample.counters.get(PREFIX_CACHE_HITS),
        num_preemptions=sample.counters.get(NUM_PREEMPTIONS),
        kv_cache_usage=sample.gauges.get(KV_CACHE_USAGE),
        num_running=sample.gauges.get(NUM_RUNNING),
        num_waiting=sample.gauges.get(NUM_WAITING),
        num_gpu_blocks=sample.num_gpu_blocks,
        idle_before_evict=idle.buckets if (idle := sample.histograms.get(BLOCK_IDLE_BEFORE_EVICT)) else None,
    )


def failed_scrape(pod: str, at: float, error: str) -> PodMetrics:
    """The record of a scrape that failed."""
    return PodMetrics(pod, at, None, None, None, None, None, None, None, error)
