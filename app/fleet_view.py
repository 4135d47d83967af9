"""Plain functions behind the Fleet pages: tables of pods, the index rebuilt from the history, prompts.

No Streamlit here (the pages lay out what these return). Two views of the fleet:

    live      this console's collector: `FleetIndex` and `PodStats` (app.fleet_hosting)
    history   the database, whoever wrote it: `storage.read.fleet_queries`; for the prefix tree and routing
              the held blocks are loaded into a `FleetIndex` (`index_from_history`), so both views
              answer through the same code

A pod's status is its health (fleet.health: live, idle, down, unreachable, or stale when silent with
no link known); "closed" when its collector stopped watching it, "collector gone" when that collector
stopped without closing it. Stale pods are marked, never dropped.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from fleet.events import BatchOrigin, BlockStored, EventBatch, LinkState, PodBatch, PodMetrics
from fleet.events import PodStatus as LinkReport
from fleet.health import PodHealth, pod_health
from fleet.index import DEFAULT_STALE_AFTER_S, FleetIndex, PodSummary, RouteResult
from fleet.pod_stats import PodStats
from fleet.prefix_tree import PrefixTree
from fleet.source import PodSource
from storage.read import fleet_queries
from storage.read.queries import Readable



class PodStatus(enum.StrEnum):
    """How a pod's row reads: its health (fleet.health), or how the history knows it."""

    LIVE = "live"  # heard from within stale_after_s
    IDLE = "idle"  # connected and quiet: its blocks as last seen, not stale
    DOWN = "down"  # the connection was lost (stale)
    UNREACHABLE = "unreachable"  # nothing listens at its endpoint (stale)
    STALE = "stale"  # silent for longer, and no link known (stale)
    NEVER = "never heard"  # watched, but nothing arrived yet
    CLOSED = "closed"  # its collector stopped watching it
    ORPHANED = "collector gone"  # its collector stopped without closing it (killed): stale


_STATUS_OF_HEALTH = {
    PodHealth.LIVE: PodStatus.LIVE,
    PodHealth.IDLE: PodStatus.IDLE,
    PodHealth.DOWN: PodStatus.DOWN,
    PodHealth.UNREACHABLE: PodStatus.UNREACHABLE,
    PodHealth.SILENT: PodStatus.STALE,
}
STALE_STATUSES = {PodStatus.DOWN, PodStatus.UNREACHABLE, PodStatus.STALE, PodStatus.ORPHANED}
HIT_RATE_WINDOW_S = 60.0  # the windowed hit rate: between the latest scrape and one about this old
COLLECTOR_LOST_AFTER_S = 30.0  # a watching source without a status for this long has lost its collector


@dataclass(frozen=True)
class MetricsSummary:
    """What a pod's /metrics said lately: the figures vLLM's Grafana dashboard leads with."""

    kv_usage: float | None  # fraction of KV blocks in use, latest scrape
    capacity_blocks: int | None  # the pool's size in blocks (cache_config_info)
    hit_rate: float | None  # prefix-cache hit rate in tokens over about HIT_RATE_WINDOW_S; None if idle
    lifetime_hit_rate: float | None  # hits / queries since the server started
    error: str | None  # why the latest scrape failed


def metrics_summary(scrapes: Sequence[PodMetrics]) -> MetricsSummary:
    """Summarize a pod's scrapes (oldest first): the latest values, the windowed and the lifetime hit rate."""
    ok = [scrape for scrape in scrapes if scrape.error is None]
    error = scrapes[-1].error if scrapes else None
    if not ok:
        return MetricsSummary(None, None, None, None, error)
    latest = ok[-1]
    lifetime = None
    if latest.prefix_cache_queries and latest.prefix_cache_hits is not None:
        lifetime = latest.prefix_cache_hits / latest.prefix_cache_queries
    window = None
    earlier = [scrape for scrape in ok[:-1] if scrape.at <= latest.at - HIT_RATE_WINDOW_S] or ok[:1]
    before = earlier[-1]
    if before is not latest and None not in (
        before.prefix_cache_queries, before.prefix_cache_hits, latest.prefix_cache_queries, latest.prefix_cache_hits
    ):
        queries = latest.prefix_cache_queries - before.prefix_cache_queries
        hits = latest.prefix_cache_hits - before.prefix_cache_hits
        if queries < 0 or hits < 0:  # a restarted server: its counters started again
            queries, hits = latest.prefix_cache_queries, latest.prefix_cache_hits
        window = hits / queries if queries > 0 else None
    return MetricsSummary(latest.kv_cache_usage, latest.num_gpu_blocks, window, lifetime, error)


def metrics_frame(scrapes: Sequence[PodMetrics]) -> pd.DataFrame:
    """A pod's scrapes as rows for the history charts: at, kv_usage, hit_rate (between consecutive
    scrapes), preemptions (between them), running, waiting."""
    rows = []
    previous = None
    for scrape in scrapes:
        if scrape.error is not None:
            continue
        rate = preempted = None
        if previous is not None:
            rate = _delta_rate(previous, scrape)
            if previous.num_preemptions is not None and scrape.num_preemptions is not None:
                preempted = max(0.0, scrape.num_preemptions - previous.num_preemptions)
        rows.append(
            {
                "at": pd.Timestamp(scrape.at, unit="s"),
                "kv_usage": scrape.kv_cache_usage,
                "hit_rate": rate,
                "preemptions": preempted,
                "running": scrape.num_running,
                "waiting": scrape.num_waiting,
            }
        )
        previous = scrape
    return pd.DataFrame(rows, columns=["at", "kv_usage", "hit_rate", "preemptions", "running", "waiting"])


def _delta_rate(before: PodMetrics, after: PodMetrics) -> float | None:
    values = (
        before.prefix_cache_queries, before.prefix_cache_hits, after.prefix_cache_queries, after.prefix_cache_hits
    )  # fmt: skip
    if None in values:
        return None
    queries, hits = values[2] - values[0], values[3] - values[1]
    if queries < 0 or hits < 0:
        queries, hits = values[2], values[3]
    return hits / queries if queries > 0 else None


def scrapes_from_history(frame: pd.DataFrame, pod: str) -> list[PodMetrics]:
    """fleet_queries.metrics_history rows of one source as PodMetrics records, oldest first."""
    return [
        PodMetrics(
            pod, float(row.at), _known(row.prefix_cache_queries), _known(row.prefix_cache_hits),
            _known(row.num_preemptions), _known(row.kv_cache_usage), _known(row.num_running),
            _known(row.num_waiting), None if _known(row.num_gpu_blocks) is None else int(row.num_gpu_blocks),
            _text(row.error),
        )  # fmt: skip
        for row in frame.itertuples()
    ]


def history_pods(db: Readable, now: float, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> pd.DataFrame:
    """Every pod the database knows (its newest source): status, blocks held by medium, last heard, and
    its latest /metrics (if scraped).

    Returns:
        One row per pod: pod, status, stale, blocks, capacity, hashes, kv_usage, hit_rate,
        lifetime_hit_rate, last_batch_s_ago, lost_batches, restarts, link, collector_id, source_id,
        endpoint, metrics_url, one "<medium> blocks" column per medium.
    """
    sources = fleet_queries.latest_sources(db)
    summary = fleet_queries.held_summary(db, sources["id"].tolist()) if len(sources) else None
    since = now - 2 * HIT_RATE_WINDOW_S
    scraped = fleet_queries.metrics_history(db, sources["id"].tolist(), since) if len(sources) else None
    rows = []
    for source in sources.itertuples():
        held = summary[summary["source_id"] == source.id] if summary is not None else None
        heard = _known(source.last_received_at)
        status = _history_status(source, heard, now, stale_after_s)
        measured = metrics_summary(
            scrapes_from_history(scraped[scraped["source_id"] == source.id], source.pod) if scraped is not None else []
        )
        row = {
            "pod": source.pod,
            "status": status.value,
            "stale": status in STALE_STATUSES,
            "blocks": int(held["blocks"].sum()) if held is not None else 0,
            "capacity": measured.capacity_blocks,
            "hashes": int(held["hashes"].sum()) if held is not None else 0,
            "kv_usage": measured.kv_usage,
            "hit_rate": measured.hit_rate,
            "lifetime_hit_rate": measured.lifetime_hit_rate,
            "last_batch_s_ago": None if heard is None else max(0.0, now - heard),
            "lost_batches": None if _known(source.num_lost_batches) is None else int(source.num_lost_batches),
            "restarts": None if _known(source.num_restarts) is None else int(source.num_restarts),
            "link": _text(source.link),
            "collector_id": source.collector_id,
            "source_id": source.id,
            "endpoint": source.endpoint,
            "metrics_url": _text(source.metrics_url),
        }
        if held is not None:
            for medium, blocks in held.groupby("medium")["blocks"].sum().items():
                row[f"{medium} blocks"] = int(blocks)
        rows.append(row)
    return pd.DataFrame(rows)


def _history_status(source, heard: float | None, now: float, stale_after_s: float) -> PodStatus:
    """A stored source's status: closed, its collector gone, never heard, or its health."""
    if _known(source.closed_at) is not None:
        return PodStatus.CLOSED
    status_at = _known(source.status_at)
    if status_at is not None and now - status_at > COLLECTOR_LOST_AFTER_S:
        return PodStatus.ORPHANED
    link_text = _text(source.link)
    link = None if link_text is None else LinkState(link_text)
    if heard is None and link in (None, LinkState.CONNECTED, LinkState.CONNECTING):
        return PodStatus.NEVER if now - source.opened_at <= stale_after_s or link else PodStatus.STALE
    return _STATUS_OF_HEALTH[pod_health(link, now - (heard or source.opened_at), stale_after_s)]


def live_pods(
    summaries: Sequence[PodSummary], stats: Mapping[str, PodStats], metrics: Mapping[str, MetricsSummary]
) -> pd.DataFrame:
    """This console's collector: one row per pod with the index's blocks, the feed's health and metrics."""
    rows = []
    for pod in summaries:
        feed = stats.get(pod.pod)
        measured = metrics.get(pod.pod)
        status = _STATUS_OF_HEALTH[pod.health]
        if pod.last_received_at is None and not pod.stale:
            status = PodStatus.NEVER
        row = {
            "pod": pod.pod,
            "status": status.value,
            "stale": pod.stale,
            "blocks": pod.num_blocks,
            "capacity": None if measured is None else measured.capacity_blocks,
            "hashes": sum(group.num_hashes for group in pod.groups),
            "kv_usage": None if measured is None else measured.kv_usage,
            "hit_rate": None if measured is None else measured.hit_rate,
            "lifetime_hit_rate": None if measured is None else measured.lifetime_hit_rate,
            "last_batch_s_ago": None if pod.last_received_at is None else pod.seconds_silent,
            "batches": pod.num_batches,
            "link": None if feed is None else feed.link.value,
            "lag_ms": None if feed is None or feed.last_lag_s is None else feed.last_lag_s * 1e3,
            "lost_batches": None if feed is None else feed.num_lost_batches,
            "catch-ups": None if feed is None else feed.num_replays,
            "feed_errors": None if feed is None else feed.num_errors,
            "restarts": pod.num_resets,
            "unknown_removals": pod.num_unknown_removals,
            "metrics_error": None if measured is None else measured.error,
        }
        for group in pod.groups:
            key = f"{group.medium} blocks"
            row[key] = row.get(key, 0) + group.num_blocks
        rows.append(row)
    return pd.DataFrame(rows)


def index_from_history(db: Readable, now: float, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> FleetIndex:
    """A FleetIndex holding what the database says each pod (its newest source) holds now.

    Each held block enters as a one-block BlockStored per copy, under its stored parent and tokens, in
    a batch of its store time (so its age comes along), and the index's prefix tree and routing read
    the history exactly as they read a live feed. The pods' last-heard times come along, so stale pods
    stay stale.
    """
    index = FleetIndex(stale_after_s=stale_after_s, clock=lambda: now)
    sources = fleet_queries.latest_sources(db)
    for source in sources.itertuples():
        pod = PodSource(source.pod, source.endpoint, _text(source.replay_endpoint), _text(source.topic) or "")
        index.open_pod(pod, source.opened_at)
        link, status_at = _text(source.link), _known(source.status_at)
        heartbeat = status_at is not None and now - status_at <= COLLECTOR_LOST_AFTER_S
        watched = _known(source.closed_at) is None and heartbeat
        if link is not None and watched:  # else no link is known: silence alone makes it stale
            lost, restarts = int(source.num_lost_batches or 0), int(source.num_restarts or 0)
            index.pod_status(LinkReport(source.pod, status_at, LinkState(link), lost, restarts))
        held = fleet_queries.held_blocks(db, source.id)
        if held.empty:
            continue
        by_time: dict[float, list[BlockStored]] = {}  # stored_at -> its blocks, so ages survive the trip
        for block in held.itertuples():
            tokens = tuple(block.token_ids) if block.token_ids is not None else ()
            parent_text = _text(block.parent_hash)
            parent = None if parent_text is None else fleet_queries.parse_hash_text(parent_text)
            stored = BlockStored(
                (fleet_queries.parse_hash_text(block.block_hash),), parent, tokens, int(block.block_size),
                block.medium, int(block.group_idx),
            )  # fmt: skip
            by_time.setdefault(float(block.stored_at), []).extend([stored] * int(block.copies))
        heard = _known(source.last_received_at) or source.opened_at
        for seq, (stored_at, events) in enumerate(sorted(by_time.items())):
            batch = EventBatch(stored_at, tuple(events), None)
            index.apply_batch(PodBatch(source.pod, seq, batch, heard, BatchOrigin.REPLAY))
    return index


def _known(value) -> float | None:
    """A float column's value, None for NULL (pandas gives None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def _text(value) -> str | None:
    """A text column's value, None for NULL (pandas 3 reads a NULL string as NaN)."""
    return value if isinstance(value, str) else None


def media_and_groups(summaries: Sequence[PodSummary]) -> list[tuple[str, int]]:
    """Every (medium, group) some pod holds blocks in, GPU group 0 first when present."""
    found = {(group.medium, group.group_idx) for pod in summaries for group in pod.groups}
    return sorted(found, key=lambda key: (key != ("GPU", 0), key))


TREE_COLUMNS = [
    "node_id", "parent_id", "depth", "num_tokens", "replicas", "copies", "pods", "age_s", "idle_s",
    "tokens_below", "token_ids",
]  # fmt: skip


def tree_frame(tree: PrefixTree, now: float) -> pd.DataFrame:
    """The prefix tree's nodes as rows: node_id, parent_id, depth, num_tokens, replicas, copies, pods,
    age_s (since its oldest block was stored), idle_s (since a copy was last stored), tokens_below (its
    tokens and all its descendants'), token_ids."""
    below = [len(node.token_ids) for node in tree.nodes]
    for node in reversed(tree.nodes):  # parents come before children
        if node.parent_id is not None:
            below[node.parent_id] += below[node.node_id]
    return pd.DataFrame(
        [
            {
                "node_id": node.node_id,
                "parent_id": node.parent_id,
                "depth": node.depth,
                "num_tokens": node.num_tokens,
                "replicas": node.replicas,
                "copies": node.copies,
                "pods": ", ".join(sorted(node.pods)),
                "age_s": max(0.0, now - node.first_stored),
                "idle_s": max(0.0, now - node.last_stored),
                "tokens_below": below[node.node_id],
                "token_ids": node.token_ids,
            }
            for node in tree.nodes
        ],
        columns=TREE_COLUMNS,
    )


def route_frame(result: RouteResult) -> pd.DataFrame:
    """Each pod's longest cached prefix of the prompt, best first."""
    return pd.DataFrame(
        [
            {
                "pod": match.pod,
                "cached blocks": match.matched_blocks,
                "cached tokens": match.matched_tokens,
                "share of prompt": match.matched_tokens / result.num_prompt_tokens if result.num_prompt_tokens else 0.0,
                "stale": match.stale,
            }
            for match in result.matches
        ],
        columns=["pod", "cached blocks", "cached tokens", "share of prompt", "stale"],
    )


def short_hash(text: str, keep: int = 6) -> str:
    """A stored hash text shortened for a table: its first and last `keep` characters around an ellipsis."""
    return text if len(text) <= 2 * keep + 1 else f"{text[:keep]}…{text[-keep:]}"


def idle_before_evict_frame(scrapes: Sequence[PodMetrics]) -> pd.DataFrame:
    """vLLM's idle-before-eviction histogram (kv_block_idle_before_evict_seconds, from `--kv-cache-metrics`)
    over the scrapes given: the latest minus the earliest, per bucket (the latest alone when a counter
    went down: a restarted server), as bin_start, bin_end, evictions. Empty when not exposed."""
    found = [scrape.idle_before_evict for scrape in scrapes if scrape.idle_before_evict]
    if not found:
        return pd.DataFrame(columns=["bin_start", "bin_end", "evictions"])
    latest, earliest = dict(found[-1]), dict(found[0]) if len(found) > 1 else {}
    if any(latest.get(bound, 0.0) < count for bound, count in earliest.items()):
        earliest = {}
    rows, lower, below = [], 0.0, 0.0
    for bound in sorted(latest):
        cumulative = latest[bound] - earliest.get(bound, 0.0)
        rows.append({"bin_start": lower, "bin_end": bound, "evictions": max(0.0, cumulative - below)})
        lower, below = bound, cumulative
    return pd.DataFrame(rows, columns=["bin_start", "bin_end", "evictions"])
