"""The eviction log and its aggregates: filtered pages, counts, counts over time, histograms, CSV export.

Counts, charts and histograms read the per-minute rollups (storage.write.rollups) for whole minutes and
the log itself only for partial minutes and for request or key filters, so their cost follows the
minutes in range, not the rows.

Invariants:
    * The eviction log is ordered newest first by (time, id); a page's `next_cursor` is its last row,
      so following cursors visits every matching row exactly once, even while rows are inserted
      (rows newer than the first page are simply not part of that walk).
    * Histograms return every bin, empty ones included, so charts keep their shape.
    * Aggregates give the same numbers from rollups as from a scan of the log.
"""

from __future__ import annotations

import io
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pandas as pd
from sqlalchemy import ColumnElement, Connection, and_, case, func, select, tuple_
from sqlalchemy.engine import Dialect

from storage.buckets import bucket_index
from storage.read.access import Readable, connect, frame
from storage.schema import (
    AGE_BIN_COLUMNS,
    AGE_EDGES_S,
    EVICTION_COLUMNS,
    EVICTIONS,
    HIT_BIN_COLUMNS,
    HIT_EDGES,
    ROLLUP_SECONDS,
    ROLLUPS,
)
from storage.write.rollups import minute_of

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class EvictionFilters:
    """Which evictions a page shows. Every field narrows; the defaults select everything."""

    since: float | None = None  # epoch seconds, inclusive
    until: float | None = None  # epoch seconds, exclusive
    reasons: tuple[str, ...] = ()  # EvictReason values; empty means all
    request_id: str | None = None  # the request whose allocation evicted the block
    run_id: str | None = None
    key_prefix: str | None = None  # leading hex digits of the block key (any case)


@dataclass(frozen=True)
class Cursor:
    """Position in the eviction log: the (time, id) of the last row shown."""

    time: float
    id: int


@dataclass(frozen=True)
class EvictionPage:
    rows: pd.DataFrame  # EVICTION_COLUMNS, newest first
    next_cursor: Cursor | None  # None when no rows follow



def _eviction_conditions(filters: EvictionFilters) -> list[ColumnElement[bool]]:
    table = EVICTIONS
    conditions: list[ColumnElement[bool]] = []
    if filters.since is not None:
        conditions.append(table.c.time >= filters.since)
    if filters.until is not None:
        conditions.append(table.c.time < filters.until)
    if filters.reasons:
        conditions.append(table.c.reason.in_(filters.reasons))
    if filters.request_id is not None:
        conditions.append(table.c.request_id == filters.request_id)
    if filters.run_id is not None:
        conditions.append(table.c.run_id == filters.run_id)
    if filters.key_prefix:
        prefix = filters.key_prefix.lower()
        if not _HEX.fullmatch(prefix):
            raise ValueError(f"key prefix must be hex digits, got {filters.key_prefix!r}")
        # Keys are lowercase hex, so every key starting with `prefix` sorts in [prefix, prefix + "g").
        conditions.append(and_(table.c.key_hex >= prefix, table.c.key_hex < prefix + "g"))
    return conditions


def eviction_log(
    db: Readable, filters: EvictionFilters = EvictionFilters(), page_size: int = 50, after: Cursor | None = None
) -> EvictionPage:
    """One page of the eviction log, newest first, starting after `after`.

    Args:
        db: where to read.
        filters: which evictions.
        page_size: most rows returned.
        after: the previous page's `next_cursor`; None for the first page.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    table = EVICTIONS
    conditions = _eviction_conditions(filters)
    if after is not None:
        conditions.append(tuple_(table.c.time, table.c.id) < tuple_(after.time, after.id))
    statement = (
        select(*(table.c[name] for name in EVICTION_COLUMNS))
        .where(*conditions)
        .order_by(table.c.time.desc(), table.c.id.desc())
        .limit(page_size + 1)
    )
    with connect(db) as connection:
        rows = frame(connection, statement, EVICTION_COLUMNS)
    if len(rows) <= page_size:
        return EvictionPage(rows, None)
    rows = rows.iloc[:page_size]
    last = rows.iloc[-1]
    return EvictionPage(rows, Cursor(float(last["time"]), int(last["id"])))


def eviction_count(db: Readable, filters: EvictionFilters = EvictionFilters(), *, use_rollups: bool = True) -> int:
    """How many evictions match `filters` (from the rollups where they can answer, unless told not to)."""
    total = 0
    with connect(db) as connection:
        split = _split_by_minute(filters, connection.dialect) if use_rollups else None
        raw_parts = [_eviction_conditions(filters)]
        if split is not None:
            rollup_conditions, raw_parts = split
            total += connection.scalar(
                select(func.coalesce(func.sum(ROLLUPS.c.evictions), 0)).where(*rollup_conditions)
            )
        for conditions in raw_parts:
            total += connection.scalar(select(func.count()).select_from(EVICTIONS).where(*conditions))
    return int(total)


def evictions_over_time(
    db: Readable,
    bucket_seconds: float = 60.0,
    filters: EvictionFilters = EvictionFilters(),
    *,
    use_rollups: bool = True,
) -> pd.DataFrame:
    """Evictions per time bucket and reason.

    Whole-minute buckets without request or key filters read the per-minute rollups (plus the log
    rows of a partial first and last minute); other requests, or `use_rollups=False`, scan the log.

    Returns:
        Columns bucket_start (epoch s), reason, evictions; ordered by bucket_start, reason.
        Buckets without evictions are absent.
    """
    with connect(db) as connection:
        whole_minutes = use_rollups and bucket_seconds % ROLLUP_SECONDS == 0
        split = _split_by_minute(filters, connection.dialect) if whole_minutes else None
        if split is None:
            counts = _raw_over_time(connection, bucket_seconds, _eviction_conditions(filters))
        else:
            rollup_conditions, raw_parts = split
            per_bucket = ROLLUPS.c.minute // int(bucket_seconds // ROLLUP_SECONDS)
            statement = (
                select(per_bucket, ROLLUPS.c.reason, func.sum(ROLLUPS.c.evictions))
                .where(*rollup_conditions)
                .group_by(per_bucket, ROLLUPS.c.reason)
            )
            counts = Counter({(bucket, reason): count for bucket, reason, count in connection.execute(statement).all()})
            for conditions in raw_parts:
                counts.update(_raw_over_time(connection, bucket_seconds, conditions))
    rows = sorted((bucket * float(bucket_seconds), reason, int(count)) for (bucket, reason), count in counts.items())
    return pd.DataFrame(rows, columns=["bucket_start", "reason", "evictions"]).astype(
        {"bucket_start": "float64", "evictions": "int64"}
    )


def _raw_over_time(connection: Connection, bucket_seconds: float, conditions: list) -> Counter[tuple[int, str]]:
    buckets = (
        select(bucket_index(connection.dialect, EVICTIONS.c.time, bucket_seconds).label("bucket"), EVICTIONS.c.reason)
        .where(*conditions)
        .subquery()
    )
    statement = select(buckets.c.bucket, buckets.c.reason, func.count()).group_by(buckets.c.bucket, buckets.c.reason)
    return Counter({(bucket, reason): count for bucket, reason, count in connection.execute(statement).all()})


def age_at_eviction_histogram(
    db: Readable, filters: EvictionFilters = EvictionFilters(), *, use_rollups: bool = True
) -> pd.DataFrame:
    """How old blocks were when evicted (seconds since filled), in the bins of AGE_EDGES_S.

    Returns:
        Columns bin_start, bin_end (inf for the last bin), evictions; one row per bin.
    """
    return _histogram(db, filters, EVICTIONS.c.age_s, AGE_EDGES_S, AGE_BIN_COLUMNS, use_rollups)


def hits_before_eviction_histogram(
    db: Readable, filters: EvictionFilters = EvictionFilters(), *, use_rollups: bool = True
) -> pd.DataFrame:
    """How many prefix hits blocks served before eviction, in the bins of HIT_EDGES (0, 1, 2, 3-4, ...).

    Returns:
        Columns bin_start, bin_end (inf for the last bin), evictions; one row per bin.
    """
    return _histogram(db, filters, EVICTIONS.c.hit_count, HIT_EDGES, HIT_BIN_COLUMNS, use_rollups)


def _histogram(
    db: Readable,
    filters: EvictionFilters,
    column: ColumnElement,
    edges: Sequence[float],
    rollup_columns: Sequence[str],
    use_rollups: bool,
) -> pd.DataFrame:
    counts = [0] * (len(edges) + 1)
    with connect(db) as connection:
        split = _split_by_minute(filters, connection.dialect) if use_rollups else None
        if split is None:
            raw_parts = [_eviction_conditions(filters)]
        else:
            rollup_conditions, raw_parts = split
            sums = select(*(func.coalesce(func.sum(ROLLUPS.c[name]), 0) for name in rollup_columns))
            counts = [int(value) for value in connection.execute(sums.where(*rollup_conditions)).one()]
        bin_index = case(*((column < edge, index) for index, edge in enumerate(edges)), else_=len(edges))
        for conditions in raw_parts:
            bins = select(bin_index.label("bin")).where(column.is_not(None), *conditions).subquery()
            for index, count in connection.execute(select(bins.c.bin, func.count()).group_by(bins.c.bin)).all():
                counts[index] += int(count)
    return pd.DataFrame(
        {"bin_start": [0.0, *map(float, edges)], "bin_end": [*map(float, edges), math.inf], "evictions": counts}
    )


def _split_by_minute(filters: EvictionFilters, dialect: Dialect) -> tuple[list, list[list]] | None:
    """Cut a query into rollup minutes and log rows, or None when only the log can answer.

    [since, until) becomes: the log rows of since's minute at or after since, the rollups of the
    minutes strictly between, and the log rows of until's minute before until. Each part selects by
    the same minute expression as the rollups, so every row is counted exactly once.

    Returns:
        (conditions on eviction_rollups, the full conditions on evictions of each partial minute).
    """
    if filters.request_id is not None or filters.key_prefix:
        return None
    first = None if filters.since is None else minute_of(filters.since)
    last = None if filters.until is None else minute_of(filters.until)
    if first is not None and first == last:
        return None
    rollup_conditions: list = []
    if filters.reasons:
        rollup_conditions.append(ROLLUPS.c.reason.in_(filters.reasons))
    if filters.run_id is not None:
        rollup_conditions.append(ROLLUPS.c.run_id == filters.run_id)
    raw_parts: list[list] = []
    minute = bucket_index(dialect, EVICTIONS.c.time, ROLLUP_SECONDS)
    # Each partial minute keeps one bound of [since, until) (the other one holds by the minute test)
    # plus a loose opposite bound, so an index scans about a minute of rows; the minute test decides.
    if first is not None:
        rollup_conditions.append(ROLLUPS.c.minute > first)
        head = _eviction_conditions(replace(filters, until=None))
        raw_parts.append([*head, minute == first, EVICTIONS.c.time < (first + 2) * ROLLUP_SECONDS])
    if last is not None:
        rollup_conditions.append(ROLLUPS.c.minute < last)
        tail = _eviction_conditions(replace(filters, since=None))
        raw_parts.append([*tail, minute == last, EVICTIONS.c.time >= (last - 1) * ROLLUP_SECONDS])
    return rollup_conditions, raw_parts



def export_evictions_csv(db: Readable, filters: EvictionFilters = EvictionFilters(), chunk_rows: int = 10_000) -> str:
    """Every eviction matching `filters` as CSV (header + EVICTION_COLUMNS), newest first.

    Reads in keyset pages of `chunk_rows`, so memory holds one page of rows plus the text.
    """
    out = io.StringIO()
    page = eviction_log(db, filters, chunk_rows)
    page.rows.to_csv(out, index=False)
    while page.next_cursor is not None:
        page = eviction_log(db, filters, chunk_rows, after=page.next_cursor)
        page.rows.to_csv(out, index=False, header=False)
    return out.getvalue()
