"""Prefix-cache reuse over time, from the request records."""

from __future__ import annotations

import pandas as pd
from sqlalchemy import case, func, select

from storage.buckets import bucket_index
from storage.read.access import Readable, connect, frame
from storage.schema import REQUESTS


def hit_rate_over_time(
    db: Readable,
    bucket_seconds: float = 60.0,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> pd.DataFrame:
    """Reuse in tokens per bucket of first-schedule time, from the request records, split the way the
    engine's counters split it (engine/core/scheduler.py's ReuseCounters): prefix-index hits apart from fork
    sharing.

    A request's reused tokens are those its first prefill did not compute: its replay boundary r (the
    hit position h minus what was replayed; rows written before revision 0002, which lack r, count h).

    Returns:
        Columns bucket_start, requests, prompt_tokens, cached_tokens (hit positions h, forks included),
        computed_tokens, prefix_query_tokens and prefix_hit_tokens (requests that looked their prompt up
        in the prefix index, and the tokens it served), disk_hit_tokens (of those, the tokens promoted from
        the disk tier; the rest came from the pool's memory), fork_query_tokens and fork_shared_tokens (fork
        children, and the tokens they shared), hit_rate = prefix_hit_tokens / prefix_query_tokens
        (vLLM's prefix-cache hit rate) and fork_share = fork_shared_tokens / fork_query_tokens (NaN
        where the denominator is 0). Requests not scheduled yet, or not recorded yet, are not counted.
    """
    scheduled_at = REQUESTS.c.first_scheduled_time
    conditions = [scheduled_at.is_not(None)]
    if run_id is not None:
        conditions.append(REQUESTS.c.run_id == run_id)
    if since is not None:
        conditions.append(scheduled_at >= since)
    if until is not None:
        conditions.append(scheduled_at < until)
    is_fork = REQUESTS.c.hit_source == "fork"
    reused = func.coalesce(REQUESTS.c.r, REQUESTS.c.cached_tokens)
    with connect(db) as connection:
        scheduled = (
            select(
                bucket_index(connection.dialect, scheduled_at, bucket_seconds).label("bucket"),
                REQUESTS.c.prompt_tokens,
                REQUESTS.c.cached_tokens,
                REQUESTS.c.computed_tokens,
                case((is_fork, 0), else_=REQUESTS.c.prompt_tokens).label("prefix_query_tokens"),
                case((is_fork, 0), else_=reused).label("prefix_hit_tokens"),
                case((is_fork, 0), else_=REQUESTS.c.disk_cached_tokens).label("disk_hit_tokens"),
                case((is_fork, REQUESTS.c.prompt_tokens), else_=0).label("fork_query_tokens"),
                case((is_fork, reused), else_=0).label("fork_shared_tokens"),
            )
            .where(*conditions)
            .subquery()
        )
        token_columns = (
            "prompt_tokens", "cached_tokens", "computed_tokens", "prefix_query_tokens", "prefix_hit_tokens",
            "disk_hit_tokens", "fork_query_tokens", "fork_shared_tokens",
        )  # fmt: skip
        statement = (
            select(
                scheduled.c.bucket,
                func.count().label("requests"),
                *(func.sum(scheduled.c[name]).label(name) for name in token_columns),
            )
            .group_by(scheduled.c.bucket)
            .order_by(scheduled.c.bucket)
        )
        buckets = frame(connection, statement)
    buckets.insert(0, "bucket_start", buckets.pop("bucket").astype("int64") * float(bucket_seconds))
    for name in ("requests", *token_columns):
        buckets[name] = buckets[name].astype("int64")
    buckets["hit_rate"] = buckets["prefix_hit_tokens"] / buckets["prefix_query_tokens"].where(buckets["prefix_query_tokens"] > 0)
    buckets["fork_share"] = buckets["fork_shared_tokens"] / buckets["fork_query_tokens"].where(buckets["fork_query_tokens"] > 0)
    return buckets
