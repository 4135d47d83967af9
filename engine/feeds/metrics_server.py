"""The engine's metrics under vLLM's names, on a Prometheus endpoint, so vLLM's dashboards read it as is.

    vllm:prefix_cache_queries      counter    prompt tokens looked up in the prefix index
    vllm:prefix_cache_hits         counter    of which found there (tokens)
    vllm:prompt_tokens_cached      counter    cached prompt tokens (the same: no external cache here)
    vllm:num_preemptions           counter    requests preempted
    vllm:kv_cache_usage_perc       gauge      referenced blocks / blocks, 0..1
    vllm:num_requests_running      gauge      requests running
    vllm:num_requests_waiting      gauge      requests waiting
    prefix_console:forward_threads gauge      threads the forward runs on now (engine/runner/thread_governor.py)
    prefix_console:forward_seconds counter    seconds of stepping at each thread count (label `threads`)
    prefix_console:forward_thread_changes counter  times the governor moved the thread count
    prefix_console:kv_tier_*       counters   the disk tier's hit tokens, stores, loads, bytes, drops and
                                              corrupt loads, and the gauge of its fill (only with a tier)
    vllm:kv_block_lifetime_seconds           histogram  allocation -> eviction, per evicted block
    vllm:kv_block_idle_before_evict_seconds  histogram  last allocation, hit or release -> eviction
    vllm:kv_block_reuse_gap_seconds          histogram  between consecutive prefix hits of a block
                                                        (its last four, observed when it is evicted)

Every series carries vLLM's labels `model_name` (the loaded model) and `engine` ("0"). The counters and
gauges are read from the engine's stats at scrape time; the histograms come from the engine's events
(EVICT carries age_s and last_used, HIT names its blocks), every block counted where vLLM samples 1%,
with vLLM's residency buckets. The server binds 127.0.0.1 only.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from typing import Any, Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from engine.core.events import Event, EventKind
from engine.core.kv_tier import TierStats

BIND_ADDRESS = "127.0.0.1"
LABELS = ("model_name", "engine")
# vLLM 0.33's kv_cache_residency buckets (vllm/v1/metrics/buckets.py), in seconds.
RESIDENCY_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
)  # fmt: skip
_ACCESSES_KEPT = 4  # vLLM keeps each sampled block's last four accesses
LIFETIME = "vllm:kv_block_lifetime_seconds"
IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
REUSE_GAP = "vllm:kv_block_reuse_gap_seconds"


class _Histogram:
    """Observation counts per bucket (not cumulative) and their sum."""

    def __init__(self) -> None:
        self.counts = [0] * (len(RESIDENCY_BUCKETS_S) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(RESIDENCY_BUCKETS_S, value)] += 1  # bucket le >= value, as Prometheus
        self.total += value

    def family(self, name: str, documentation: str, labels: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=list(LABELS))
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, RESIDENCY_BUCKETS_S), "+Inf"), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(labels, buckets, self.total)
        return family


class BlockResidency:
    """The residency histograms, fed by the engine's events (an engine listener). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._histograms = {name: _Histogram() for name in (LIFETIME, IDLE_BEFORE_EVICT, REUSE_GAP)}
        self._hits: dict[tuple[str, int], deque[float]] = {}  # (group, block id) -> its latest hit times

    def on_step(self, events: list[Event], views: list) -> None:
        with self._lock:
            for event in events:
                kind = event.kind
                if kind is EventKind.HIT:
                    group = event.detail["group"]
                    for block_id in event.detail["block_ids"]:
                        hits = self._hits.get((group, block_id))
                        if hits is None:
                            hits = self._hits[(group, block_id)] = deque(maxlen=_ACCESSES_KEPT)
                        hits.append(event.time)
                elif kind is EventKind.ALLOCATE:  # a new life: hits of the block's last one are gone
                    group = event.detail["group"]
                    for block_id in event.detail["block_ids"]:
                        self._hits.pop((group, block_id), None)
                elif kind is EventKind.EVICT:
                    self._evicted(event)

    def _evicted(self, event: Event) -> None:
        detail = event.detail
        self._histograms[LIFETIME].observe(detail["age_s"])
        self._histograms[IDLE_BEFORE_EVICT].observe(max(0.0, event.time - detail["last_used"]))
        hits = self._hits.pop((detail["group"], event.block_id), None)
        if hits:
            times = list(hits)
            for earlier, later in zip(times, times[1:]):
                self._histograms[REUSE_GAP].observe(later - earlier)

    def families(self, labels: list[str]) -> list[HistogramMetricFamily]:
        documentation = {
            LIFETIME: "Histogram of KV cache block lifetime from allocation to eviction.",
            IDLE_BEFORE_EVICT: "Histogram of idle time before KV cache block eviction.",
            REUSE_GAP: "Histogram of time gaps between consecutive KV cache block accesses.",
        }
        with self._lock:
            return [
                histogram.family(name, documentation[name], labels) for name, histogram in self._histograms.items()
            ]


class _EngineCollector:
    """A prometheus_client collector reading the engine's stats at every scrape."""

    def __init__(self, engine: Any, residency: BlockResidency) -> None:
        self._engine = engine
        self._residency = residency

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        labels = [str(self._engine.loaded.model_id), "0"]

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=list(LABELS))
            family.add_metric(labels, value)
            return family

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=list(LABELS))
            family.add_metric(labels, value)
            return family

        # vLLM's prefix_cache_hits are prefix-index hits only. PoolStats.prefix_hit_tokens is that once
        # the engine's reuse counters are split (issue 15: prefix hits apart from fork sharing and from
        # re-prefill after preemption); until then it also holds the tokens fork children shared.
        queries, hits = stats.prefix_query_tokens, stats.prefix_hit_tokens
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield gauge(
            "prefix_console:forward_threads",
            "Threads the engine's forward runs on now (fewer while other tasks wait for a CPU).",
            self._engine.forward_threads(),
        )
        governor = getattr(self._engine, "thread_governor", None)
        if governor is not None:  # a CPU forward on several threads: what the governor did, and for how long
            seconds = CounterMetricFamily("prefix_console:forward_seconds",
                                          "Seconds the forward stepped at each thread count.",
                                          labels=[*LABELS, "threads"])  # fmt: skip
            for threads, spent in sorted(governor.time_at_threads().items()):
                seconds.add_metric([*labels, str(threads)], spent)
            yield seconds
            yield counter("prefix_console:forward_thread_changes", "Times the thread governor moved the count.",
                          governor.changes)  # fmt: skip
        if stats.tier is not None:
            yield from _tier_families(stats.tier, counter, gauge)
        yield from self._residency.families(labels)


def _tier_families(tier: TierStats, counter: Callable[..., Metric], gauge: Callable[..., Metric]) -> Iterator[Metric]:
    """The disk tier's counters (engine/core/kv_tier.py's TierStats), under prefix_console:kv_tier_*."""
    yield counter("prefix_console:kv_tier_hit_tokens", "Prompt tokens promoted from the disk tier.", tier.hit_tokens)
    yield counter("prefix_console:kv_tier_stores", "Evicted blocks written to the disk tier.", tier.stores)
    yield counter("prefix_console:kv_tier_loads", "Blocks promoted from the disk tier into the pool.", tier.loads)
    yield counter("prefix_console:kv_tier_bytes_written", "Bytes written to the disk tier.", tier.bytes_written)
    yield counter("prefix_console:kv_tier_bytes_read", "Bytes read from the disk tier.", tier.bytes_read)
    yield counter("prefix_console:kv_tier_drops", "Evicted blocks the disk tier could not take.", tier.drops)
    yield counter("prefix_console:kv_tier_corrupt", "Disk tier loads that failed their checksum.", tier.corrupt)
    usage = tier.ready_blocks / tier.num_slots
    yield gauge("prefix_console:kv_tier_usage_perc", "Disk tier slots holding blocks, 0..1.", usage)


def engine_registry(engine: Any, residency: BlockResidency) -> CollectorRegistry:
    """A registry holding the engine's metrics (read at every scrape) and `residency`'s histograms; the
    caller feeds `residency.on_step` to the engine as a listener. Other servers (the OpenAI-compatible
    API) serve it under their own /metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine, residency))
    return registry


class MetricsServer:
    """The HTTP endpoint (GET /metrics) on 127.0.0.1, with its residency listener on the engine."""

    def __init__(self, engine: Any, port: int) -> None:
        """Start serving; `engine` needs stats(), loaded.model_id and add_listener / remove_listener.

        Args:
            port: the TCP port on 127.0.0.1 (0: any free port; `port` says which).

        Raises:
            OSError: the port cannot be bound.
        """
        self.residency = BlockResidency()  # the histograms, fed by the engine's events
        self._engine = engine
        registry = engine_registry(engine, self.residency)
        self._http, self._thread = start_http_server(port, addr=BIND_ADDRESS, registry=registry)
        self.port = self._http.server_port  # the bound port
        self.url = f"http://{BIND_ADDRESS}:{self.port}/metrics"  # where to scrape
        engine.add_listener(self.residency.on_step)

    def close(self) -> None:
        """Stop listening and serving."""
        try:
            self._engine.remove_listener(self.residency.on_step)
        except ValueError:
            pass  # closed twice
        self._http.shutdown()
        self._http.server_close()
