"""Read functions for the fleet history: what every collector sharing the database saw.

Plain functions taking `db` (an Engine, Connection or Session) and returning DataFrames, like
storage.read.queries; SQL is built from SQLAlchemy constructs only. Every collector writes only its own
sources, and these read all of them: a pod watched by several collectors (or watched again after a
restart) has one source per watch, and `latest_sources` picks the newest for each pod name.

    latest_sources(db, pods=None)                   newest source per pod, with when it was last heard
                                                    and its collector's latest status (link, heartbeat)
    metrics_history(db, source_ids, since)          the sources' /metrics scrapes, oldest first
    held_summary(db, source_ids)                    per source, medium and group: hashes and blocks held
    held_blocks(db, source_id)                      the blocks a source holds (hash, parent, tokens, copies)
    block_rates(db, source_ids, since, bucket_s)    blocks stored / removed per bucket
    eviction_log(db, source_ids, since, limit)      the newest copies that left a cache, and why
    eviction_age_histogram(db, source_ids, since)   age at eviction (BlockRemoved), in AGE_EDGES_S bins
    lifetime_histogram(db, source_ids, since)       ended lifetimes (stored -> last copy gone), same bins, by reason

Hashes are stored as text; `parse_hash_text` (re-exported from storage.write.fleet_rows) reads them back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pandas as pd
from sqlalchemy import ColumnElement, case, func, select

from storage.buckets import bucket_index
from storage.write.fleet_rows import RemovalReason
from storage.write.fleet_rows import parse_hash_text  # noqa: F401  (re-exported: readers turn hash texts back into hashes)
from storage.schema import AGE_EDGES_S, FLEET_BLOCKS, FLEET_EVENTS, FLEET_EVICTIONS, FLEET_METRICS, FLEET_SOURCES
from storage.schema import FLEET_METRICS_COLUMNS as METRICS_COLUMNS
from storage.schema import FLEET_SOURCE_COLUMNS, FLEET_SOURCE_STATUS_COLUMNS

SOURCE_COLUMNS = FLEET_SOURCE_COLUMNS + FLEET_SOURCE_STATUS_COLUMNS
from storage.read.access import Readable, connect as _connection, frame as _frame  # the read layer's connection and frame helpers

HELD_COLUMNS = (
    "medium", "group_idx", "block_hash", "parent_hash", "block_size", "token_ids", "copies", "stored_at", "n",
)  # fmt: skip
EVICTION_LOG_COLUMNS = (
    "id", "source_id", "time", "reason", "medium", "group_idx", "block_hash", "age_s", "copies_left",
)  # fmt: skip


def latest_sources(db: Readable, pods: Iterable[str] | None = None) -> pd.DataFrame:
    """The newest source of each pod (by opened_at), with when it was last heard, sorted by pod.

    Returns:
        SOURCE_COLUMNS (the status columns None until the collector's first PodStatus) plus last_ts
        (publisher time of its newest event, NaN if none) and last_received_at (collector time that
        event arrived, NaN if none).
    """
    statement = select(*(FLEET_SOURCES.c[name] for name in SOURCE_COLUMNS))
    wanted = None if pods is None else list(pods)
    if wanted is not None:
        statement = statement.where(FLEET_SOURCES.c.pod.in_(wanted))
    with _connection(db) as connection:
        sources = _frame(connection, statement.order_by(FLEET_SOURCES.c.pod, FLEET_SOURCES.c.opened_at), SOURCE_COLUMNS)
        sources = sources.drop_duplicates("pod", keep="last").reset_index(drop=True)
        heard = []
        for source_id in sources["id"]:
            newest = connection.execute(
                select(FLEET_EVENTS.c.ts, FLEET_EVENTS.c.received_at)
                .where(FLEET_EVENTS.c.source_id == source_id)
                .order_by(FLEET_EVENTS.c.ts.desc(), FLEET_EVENTS.c.id.desc())
                .limit(1)
            ).first()
            heard.append(tuple(newest) if newest is not None else (math.nan, math.nan))
    sources["last_ts"] = pd.Series([ts for ts, _ in heard], dtype="float64")
    sources["last_received_at"] = pd.Series([at for _, at in heard], dtype="float64")
    return sources


def metrics_history(db: Readable, source_ids: Sequence[str], since: float | None = None) -> pd.DataFrame:
    """The sources' /metrics scrapes (METRICS_COLUMNS), oldest first; failed scrapes included (`error`)."""
    metrics = FLEET_METRICS.c
    statement = select(*(metrics[name] for name in METRICS_COLUMNS)).where(metrics.source_id.in_(list(source_ids)))
    if since is not None:
        statement = statement.where(metrics.at >= since)
    with _connection(db) as connection:
        return _frame(connection, statement.order_by(metrics.at, metrics.id), METRICS_COLUMNS)


def held_summary(db: Readable, source_ids: Sequence[str]) -> pd.DataFrame:
    """What each source holds now, per (medium, group): distinct hashes and physical blocks.

    Returns:
        Columns source_id, medium, group_idx, hashes, blocks; sorted; (medium, group) pairs holding
        nothing are absent.
    """
    blocks = FLEET_BLOCKS.c
    statement = (
        select(blocks.source_id, blocks.medium, blocks.group_idx, func.count(), func.sum(blocks.copies))
        .where(blocks.source_id.in_(list(source_ids)))
        .group_by(blocks.source_id, blocks.medium, blocks.group_idx)
        .order_by(blocks.source_id, blocks.medium, blocks.group_idx)
    )
    columns = ("source_id", "medium", "group_idx", "hashes", "blocks")
    with _connection(db) as connection:
        frame = _frame(connection, statement, columns)
    return frame.astype({"group_idx": "int64", "hashes": "int64", "blocks": "int64"})


def held_blocks(db: Readable, source_id: str) -> pd.DataFrame:
    """The blocks one source holds, in the order their lifetimes opened.

    Returns:
        HELD_COLUMNS; token_ids is a list (None when the store's tokens did not split per block).
    """
    blocks = FLEET_BLOCKS.c
    statement = (
        select(*(blocks[name] for name in HELD_COLUMNS))
        .where(blocks.source_id == source_id)
        .order_by(blocks.n)
    )
    with _connection(db) as connection:
        return _frame(connection, statement, HELD_COLUMNS)


def block_rates(
    db: Readable, source_ids: Sequence[str], since: float, bucket_seconds: float = 10.0
) -> pd.DataFrame:
    """Blocks stored and removed per time bucket (publisher time) since `since`.

    Returns:
        Columns bucket_start, source_id, kind ("stored" | "removed"), blocks; ordered.
    """
    events = FLEET_EVENTS.c
    with _connection(db) as connection:
        buckets = (
            select(
                bucket_index(connection.dialect, events.ts, bucket_seconds).label("bucket"),
                events.source_id,
                events.kind,
                events.num_blocks,
            )
            .where(events.source_id.in_(list(source_ids)), events.ts >= since, events.kind.in_(("stored", "removed")))
            .subquery()
        )
        statement = (
            select(buckets.c.bucket, buckets.c.source_id, buckets.c.kind, func.sum(buckets.c.num_blocks))
            .group_by(buckets.c.bucket, buckets.c.source_id, buckets.c.kind)
            .order_by(buckets.c.bucket, buckets.c.source_id, buckets.c.kind)
        )
        frame = _frame(connection, statement, ("bucket", "source_id", "kind", "blocks"))
    frame.insert(0, "bucket_start", frame.pop("bucket").astype("int64") * float(bucket_seconds))
    return frame.astype({"blocks": "int64"})


def eviction_log(
    db: Readable, source_ids: Sequence[str], since: float | None = None, limit: int = 100
) -> pd.DataFrame:
    """The newest copies that left the pods' caches (storage.schema' fleet_evictions), newest first.

    Returns:
        EVICTION_LOG_COLUMNS; age_s and copies_left are NaN for hashes the pod was not known to hold.
    """
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    table = FLEET_EVICTIONS.c
    conditions = [table.source_id.in_(list(source_ids))]
    if since is not None:
        conditions.append(table.time >= since)
    statement = (
        select(*(table[name] for name in EVICTION_LOG_COLUMNS))
        .where(*conditions)
        .order_by(table.time.desc(), table.id.desc())
        .limit(limit)
    )
    with _connection(db) as connection:
        return _frame(connection, statement, EVICTION_LOG_COLUMNS)


def eviction_age_histogram(db: Readable, source_ids: Sequence[str], since: float | None = None) -> pd.DataFrame:
    """How old lifetimes were when a BlockRemoved took a copy (reason "removed"), in AGE_EDGES_S bins.

    Returns:
        Columns bin_start, bin_end (inf for the last bin), evictions; every bin; plus one row with
        bin_start NaN counting evictions of unknown age.
    """
    table = FLEET_EVICTIONS.c
    conditions = [table.source_id.in_(list(source_ids)), table.reason == RemovalReason.REMOVED.value]
    if since is not None:
        conditions.append(table.time >= since)
    counts = _binned(db, table.age_s, conditions)
    return _histogram_frame(counts, "evictions")


def lifetime_histogram(db: Readable, source_ids: Sequence[str], since: float | None = None) -> pd.DataFrame:
    """How long ended lifetimes lasted (stored -> its last copy gone), by why it went.

    A lifetime ends with the fleet_evictions row that leaves it no copy (copies_left 0); its age_s is
    the lifetime's length.

    Returns:
        Columns reason, bin_start, bin_end, lifetimes: every AGE_EDGES_S bin of every reason that
        occurred since `since`.
    """
    table = FLEET_EVICTIONS.c
    conditions = [table.source_id.in_(list(source_ids)), table.copies_left == 0]
    if since is not None:
        conditions.append(table.time >= since)
    with _connection(db) as connection:
        reasons = list(connection.scalars(select(table.reason).where(*conditions).distinct()))
    frames = []
    for reason in sorted(reasons):
        counts = _binned(db, table.age_s, [*conditions, table.reason == reason])
        frame = _histogram_frame(counts, "lifetimes").dropna(subset=["bin_start"])
        frame.insert(0, "reason", reason)
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["reason", "bin_start", "bin_end", "lifetimes"])
    return pd.concat(frames, ignore_index=True)


def _binned(db: Readable, value: ColumnElement, conditions: list) -> list[int]:
    """Counts per AGE_EDGES_S bin of `value`, and last the rows where it is NULL."""
    edges = AGE_EDGES_S
    bin_index = case(
        (value.is_(None), len(edges) + 1),
        *((value < edge, index) for index, edge in enumerate(edges)),
        else_=len(edges),
    )
    counts = [0] * (len(edges) + 2)
    with _connection(db) as connection:
        bins = select(bin_index.label("bin")).where(*conditions).subquery()
        for index, count in connection.execute(select(bins.c.bin, func.count()).group_by(bins.c.bin)).all():
            counts[int(index)] = int(count)
    return counts


def _histogram_frame(counts: list[int], name: str) -> pd.DataFrame:
    edges = list(map(float, AGE_EDGES_S))
    return pd.DataFrame(
        {"bin_start": [0.0, *edges, math.nan], "bin_end": [*edges, math.inf, math.nan], name: counts}
    )
