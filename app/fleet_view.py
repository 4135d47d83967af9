"""Plain functions behind the Fleet pages: tables of pods, the index rebuilt from the history, prompts.

No Streamlit here (the pages lay out what these return). Two views of the fleet:

    live      this console's collector: `FleetIndex` and `PodStats` (app.fleet_hosting)
    history   the database, whoever wrote it: `storage.read.fleet_queries`; for the prefix tree and routing
              the held blocks are loaded into a `FleetIndex` (`index_from_history`), so both views
              answer through the same code

A pod is "stale" when nothing arrived from it for `stale_after_s` (a pod that stops sending is marked,
never dropped), "closed" when its collector stopped watching it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from app.prompting import parse_token_ids
from serving.prompts import encode_text
from fleet.collector import PodStats
from fleet.events import BatchOrigin, BlockStored, EventBatch, PodBatch
from fleet.index import DEFAULT_STALE_AFTER_S, FleetIndex, PodSummary, PrefixTree, RouteResult
from fleet.metrics import KV_CACHE_USAGE, MetricsSample, hit_rate_between
from fleet.source import PodSource
from storage.read import fleet_queries
from storage.read.queries import Readable

MAX_PROMPT_TOKEN_IDS = 65_536  # token ids a pasted prompt may hold
MAX_TOKEN_ID = 2**32 - 1  # the wire's bound on a token id
MAX_TOKENIZER_BYTES = 64 * 2**20  # a local tokenizer.json


class PodStatus(enum.StrEnum):
    """How a pod's row reads."""

    LIVE = "live"  # heard from within stale_after_s
    STALE = "stale"  # silent for longer (still shown, its blocks as last seen)
    NEVER = "never heard"  # watched, but nothing arrived yet
    CLOSED = "closed"  # its collector stopped watching it


@dataclass(frozen=True)
class PodMetrics:
    """What a pod's /metrics said, from this console's scrapes."""

    kv_usage: float | None  # vllm:kv_cache_usage_perc of the latest scrape
    hit_rate: float | None  # prefix-cache hit rate in tokens between the two latest scrapes
    error: str | None  # why the latest scrape failed


def pod_metrics(samples: Sequence[MetricsSample], error: str | None) -> PodMetrics:
    """KV usage from the latest sample, the hit rate between the latest two (None where unknown)."""
    usage = samples[-1].gauges.get(KV_CACHE_USAGE) if samples else None
    rate = None
    if len(samples) >= 2:
        try:
            window = hit_rate_between(samples[-2], samples[-1])
        except ValueError:
            window = None
        if window is not None and window.has_queries:
            rate = window.rate
    return PodMetrics(usage, rate, error)


def history_pods(db: Readable, now: float, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> pd.DataFrame:
    """Every pod the database knows (its newest source): status, blocks held by medium, last heard.

    Returns:
        One row per pod: pod, status, blocks, hashes, one "<medium> blocks" column per medium,
        last_batch_s_ago, collector_id, source_id, endpoint, metrics_url.
    """
    sources = fleet_queries.latest_sources(db)
    summary = fleet_queries.held_summary(db, sources["id"].tolist()) if len(sources) else None
    rows = []
    for source in sources.itertuples():
        held = summary[summary["source_id"] == source.id] if summary is not None else None
        heard = _known(source.last_received_at)
        if _known(source.closed_at) is not None:
            status = PodStatus.CLOSED
        elif heard is None:
            status = PodStatus.NEVER if now - source.opened_at <= stale_after_s else PodStatus.STALE
        else:
            status = PodStatus.LIVE if now - heard <= stale_after_s else PodStatus.STALE
        row = {
            "pod": source.pod,
            "status": status.value,
            "blocks": int(held["blocks"].sum()) if held is not None else 0,
            "hashes": int(held["hashes"].sum()) if held is not None else 0,
            "last_batch_s_ago": None if heard is None else max(0.0, now - heard),
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


def live_pods(
    summaries: Sequence[PodSummary], stats: Mapping[str, PodStats], metrics: Mapping[str, PodMetrics]
) -> pd.DataFrame:
    """This console's collector: one row per pod with the index's blocks, the feed's health and metrics."""
    rows = []
    for pod in summaries:
        feed = stats.get(pod.pod)
        measured = metrics.get(pod.pod)
        if pod.last_received_at is None:
            status = PodStatus.STALE if pod.stale else PodStatus.NEVER
        else:
            status = PodStatus.STALE if pod.stale else PodStatus.LIVE
        row = {
            "pod": pod.pod,
            "status": status.value,
            "blocks": pod.num_blocks,
            "hashes": sum(group.num_hashes for group in pod.groups),
            "kv_usage": None if measured is None else measured.kv_usage,
            "hit_rate": None if measured is None else measured.hit_rate,
            "last_batch_s_ago": None if pod.last_received_at is None else pod.seconds_silent,
            "batches": pod.num_batches,
            "link": None if feed is None else feed.link.value,
            "lag_ms": None if feed is None or feed.last_lag_s is None else feed.last_lag_s * 1e3,
            "lost_batches": None if feed is None else feed.num_lost_batches,
            "replays": None if feed is None else feed.num_replays,
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

    Each held block enters as a one-block BlockStored per copy, under its stored parent and tokens, so
    the index's prefix tree and routing read the history exactly as they read a live feed. The pods'
    last-heard times come along, so stale pods stay stale.
    """
    index = FleetIndex(stale_after_s=stale_after_s, clock=lambda: now)
    sources = fleet_queries.latest_sources(db)
    for source in sources.itertuples():
        pod = PodSource(source.pod, source.endpoint, _text(source.replay_endpoint), _text(source.topic) or "")
        index.open_pod(pod, source.opened_at)
        held = fleet_queries.held_blocks(db, source.id)
        if held.empty:
            continue
        events = []
        for block in held.itertuples():
            tokens = tuple(block.token_ids) if block.token_ids is not None else ()
            parent_text = _text(block.parent_hash)
            parent = None if parent_text is None else fleet_queries.parse_hash_text(parent_text)
            stored = BlockStored(
                (fleet_queries.parse_hash_text(block.block_hash),), parent, tokens, int(block.block_size),
                block.medium, int(block.group_idx),
            )  # fmt: skip
            events.extend([stored] * int(block.copies))
        heard = _known(source.last_received_at) or source.opened_at
        ts = _known(source.last_ts) or heard
        index.apply_batch(PodBatch(source.pod, 0, EventBatch(ts, tuple(events), None), heard, BatchOrigin.REPLAY))
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


def tree_frame(tree: PrefixTree) -> pd.DataFrame:
    """The prefix tree's nodes as rows: node_id, parent_id, depth, num_tokens, replicas, copies, pods."""
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
                "token_ids": node.token_ids,
            }
            for node in tree.nodes
        ],
        columns=["node_id", "parent_id", "depth", "num_tokens", "replicas", "copies", "pods", "token_ids"],
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


def prompt_token_ids(text: str) -> list[int]:
    """Token ids pasted as text (app.prompting's syntax), bounded as the KV-event wire bounds them.

    Raises:
        ValueError: malformed, out of [0, 2**32), or more than MAX_PROMPT_TOKEN_IDS.
    """
    ids = parse_token_ids(text)
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS:,} token ids, got {len(ids):,}")
    bad = [token for token in ids if not 0 <= token <= MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside [0, 2**32)")
    return ids


def local_tokenizer(directory: str):
    """The `tokenizers` tokenizer in a local model directory's tokenizer.json (the pods' model, say).

    Raises:
        ValueError: no such directory, no tokenizer.json in it, a file over MAX_TOKENIZER_BYTES, or one
            that does not load.
    """
    from tokenizers import Tokenizer

    if len(directory) > 4096:
        raise ValueError("the path is too long")
    path = Path(directory).expanduser() / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {directory!r}")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{path} is larger than {MAX_TOKENIZER_BYTES // 2**20} MiB")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own exception type for a malformed file
        raise ValueError(f"{path} does not load: {exc}") from None


def encode_with(tokenizer, text: str) -> list[int]:
    """`text` as token ids, with the tokenizer's default special tokens: the console's own (transformers)
    tokenizer, or one `local_tokenizer` loaded.

    Raises:
        ValueError: an empty text, or too many tokens.
    """
    if not text.strip():
        raise ValueError("the prompt is empty")
    if hasattr(tokenizer, "encode_batch"):  # a `tokenizers.Tokenizer`
        ids = list(tokenizer.encode(text).ids)
    else:
        ids = encode_text(tokenizer, text)
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"the prompt is {len(ids):,} tokens; at most {MAX_PROMPT_TOKEN_IDS:,}")
    return ids
