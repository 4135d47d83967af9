"""Read-side functions for the console pages: plain functions returning DataFrames or small values.

Every function takes `db`, an Engine, Connection or Session, and builds its SQL from SQLAlchemy
expressions only. Times are epoch seconds in and out; buckets are `floor(time / bucket_seconds)`,
computed per backend so results match on SQLite and PostgreSQL.

Eviction counts, charts and histograms read the per-minute rollups (storage.write.rollups) for whole
minutes and the log itself only for partial minutes and for request or key filters, so their cost
follows the minutes in range, not the rows.

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pandas as pd
from sqlalchemy import ColumnElement, Connection, Engine, and_, case, func, or_, select, tuple_
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from storage.read import block_history
from storage.read.block_history import HISTORY_COLUMNS, StoredEvent
from storage.buckets import bucket_index
from storage.schema import (
    AGE_BIN_COLUMNS,
    AGE_EDGES_S,
    EVENTS,
    EVICTION_COLUMNS,
    EVICTIONS,
    HIT_BIN_COLUMNS,
    HIT_EDGES,
    PRUNES,
    REQUESTS,
    ROLLUP_SECONDS,
    ROLLUPS,
    RUNS,
)
from storage.write.rollups import minute_of

Readable = Engine | Connection | Session

_HEX = re.compile(r"[0-9a-f]+")
MAX_TIMELINE_BLOCKS = 256  # blocks one timeline query may ask about (a request's, a fork family's)
MAX_FAMILY = 256  # requests one fork family may list


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


@contextmanager
def _connection(db: Readable) -> Iterator[Connection]:
    if isinstance(db, Engine):
        with db.connect() as connection:
            yield connection
    elif isinstance(db, Session):
        yield db.connection()
    else:
        yield db


def _frame(connection: Connection, statement, columns: Sequence[str] | None = None) -> pd.DataFrame:
    result = connection.execute(statement)
    # Plain tuples: pandas 3 mis-infers column dtypes from SQLAlchemy Row objects.
    return pd.DataFrame([tuple(row) for row in result.all()], columns=list(columns or result.keys()))


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
    with _connection(db) as connection:
        rows = _frame(connection, statement, EVICTION_COLUMNS)
    if len(rows) <= page_size:
        return EvictionPage(rows, None)
    rows = rows.iloc[:page_size]
    last = rows.iloc[-1]
    return EvictionPage(rows, Cursor(float(last["time"]), int(last["id"])))


def eviction_count(db: Readable, filters: EvictionFilters = EvictionFilters(), *, use_rollups: bool = True) -> int:
    """How many evictions match `filters` (from the rollups where they can answer, unless told not to)."""
    total = 0
    with _connection(db) as connection:
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
    with _connection(db) as connection:
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
    with _connection(db) as connection:
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


def request_timeline(db: Readable, request_id: str, run_id: str | None = None) -> pd.DataFrame:
    """Every event of one request, in order (time, then insertion).

    Args:
        request_id: the request.
        run_id: its run; None searches every run (request ids may repeat across runs).
    """
    columns = ("id", "run_id", "step", "time", "kind", "block_id", "tokens", "detail")
    conditions = [EVENTS.c.request_id == request_id]
    if run_id is not None:
        conditions.append(EVENTS.c.run_id == run_id)
    statement = select(*(EVENTS.c[name] for name in columns)).where(*conditions).order_by(EVENTS.c.time, EVENTS.c.id)
    with _connection(db) as connection:
        return _frame(connection, statement, columns)


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
        in the prefix index, and the tokens it served), fork_query_tokens and fork_shared_tokens (fork
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
    with _connection(db) as connection:
        scheduled = (
            select(
                bucket_index(connection.dialect, scheduled_at, bucket_seconds).label("bucket"),
                REQUESTS.c.prompt_tokens,
                REQUESTS.c.cached_tokens,
                REQUESTS.c.computed_tokens,
                case((is_fork, 0), else_=REQUESTS.c.prompt_tokens).label("prefix_query_tokens"),
                case((is_fork, 0), else_=reused).label("prefix_hit_tokens"),
                case((is_fork, REQUESTS.c.prompt_tokens), else_=0).label("fork_query_tokens"),
                case((is_fork, reused), else_=0).label("fork_shared_tokens"),
            )
            .where(*conditions)
            .subquery()
        )
        token_columns = (
            "prompt_tokens", "cached_tokens", "computed_tokens", "prefix_query_tokens", "prefix_hit_tokens",
            "fork_query_tokens", "fork_shared_tokens",
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
        frame = _frame(connection, statement)
    frame.insert(0, "bucket_start", frame.pop("bucket").astype("int64") * float(bucket_seconds))
    for name in ("requests", *token_columns):
        frame[name] = frame[name].astype("int64")
    frame["hit_rate"] = frame["prefix_hit_tokens"] / frame["prefix_query_tokens"].where(frame["prefix_query_tokens"] > 0)
    frame["fork_share"] = frame["fork_shared_tokens"] / frame["fork_query_tokens"].where(frame["fork_query_tokens"] > 0)
    return frame


def runs(db: Readable, limit: int = 100) -> pd.DataFrame:
    """The newest runs first, with every column of `runs`."""
    statement = select(RUNS).order_by(RUNS.c.started_at.desc()).limit(limit)
    with _connection(db) as connection:
        return _frame(connection, statement)


def recent_requests(db: Readable, run_id: str | None = None, limit: int = 100) -> pd.DataFrame:
    """The latest requests (by arrival), of one run or of all runs, with every column of `requests`."""
    statement = select(REQUESTS).order_by(REQUESTS.c.arrival_time.desc()).limit(limit)
    if run_id is not None:
        statement = statement.where(REQUESTS.c.run_id == run_id)
    with _connection(db) as connection:
        return _frame(connection, statement)


def prune_log(db: Readable, limit: int = 100) -> pd.DataFrame:
    """The latest retention deletions: time, table_name, reason, rows_deleted."""
    statement = (
        select(PRUNES.c.time, PRUNES.c.table_name, PRUNES.c.reason, PRUNES.c.rows_deleted)
        .order_by(PRUNES.c.time.desc(), PRUNES.c.id.desc())
        .limit(limit)
    )
    with _connection(db) as connection:
        return _frame(connection, statement)


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


def prompt_chains(db: Readable, run_ids: Sequence[str] = (), limit: int = 1_000_000) -> pd.DataFrame:
    """The finished requests whose prompt keys are stored (revision 0004), oldest arrival first, for the
    workload analyzer: one row per request with `run_id`, `request_id`, `arrival_time`, `prompt_tokens`,
    `output_tokens`, `block_keys`, `content_keys` (bytes, 16 per full block) and its run's `block_size`,
    `model`, `weights_revision` and `dtype`.

    Args:
        db: the history.
        run_ids: the runs to read; empty reads every run.
        limit: at most this many requests (the oldest).
    """
    statement = (
        select(
            REQUESTS.c.run_id,
            REQUESTS.c.request_id,
            REQUESTS.c.arrival_time,
            REQUESTS.c.prompt_tokens,
            func.json_array_length(REQUESTS.c.output_token_ids).label("output_tokens"),
            REQUESTS.c.block_keys,
            REQUESTS.c.content_keys,
            RUNS.c.block_size,
            RUNS.c.model,
            RUNS.c.weights_revision,
            RUNS.c.dtype,
        )
        .join(RUNS, RUNS.c.id == REQUESTS.c.run_id)
        .where(REQUESTS.c.block_keys.is_not(None))
        .order_by(REQUESTS.c.arrival_time, REQUESTS.c.run_id, REQUESTS.c.request_id)
        .limit(limit)
    )
    if run_ids:
        statement = statement.where(REQUESTS.c.run_id.in_(list(run_ids)))
    with _connection(db) as connection:
        return _frame(connection, statement)


# ---------------------------------------------------------------------------------------------- block lives
@dataclass(frozen=True)
class BlockTimeline:
    """One block's reference-count history in one run and KV group (storage/read/block_history.py)."""

    run_id: str
    group: str  # KV group: "full" or "sliding"
    block_id: int
    rows: pd.DataFrame  # HISTORY_COLUMNS, oldest first; `holders` holds tuples of request ids
    complete: bool  # False when the stored events start mid-life (pruned) or lack block lists


def latest_run_id(db: Readable) -> str | None:
    """The newest run's id (by start time), or None for an empty history."""
    with _connection(db) as connection:
        return connection.scalar(select(RUNS.c.id).order_by(RUNS.c.started_at.desc(), RUNS.c.id.desc()).limit(1))


def has_run(db: Readable, run_id: str) -> bool:
    """Whether the history holds a run with this id."""
    with _connection(db) as connection:
        return connection.scalar(select(func.count()).select_from(RUNS).where(RUNS.c.id == run_id)) > 0


def block_timelines(
    db: Readable,
    run_id: str,
    block_ids: Sequence[int],
    group: str = "full",
    request_ids: Sequence[str] | None = None,
) -> dict[int, BlockTimeline]:
    """Every listed block's history, replayed from the run's stored events.

    Args:
        db: where to read.
        run_id: the run.
        block_ids: at most MAX_TIMELINE_BLOCKS physical blocks of `group`.
        group: the KV group.
        request_ids: when given, keep of each block's history only the stretch these requests took part
            in (`storage.read.block_history.rows_involving`).

    Returns:
        By block id, in the order asked for; a block without stored events has no rows.

    Raises:
        ValueError: too many blocks.
    """
    ids = list(dict.fromkeys(int(b) for b in block_ids))
    if len(ids) > MAX_TIMELINE_BLOCKS:
        raise ValueError(f"at most {MAX_TIMELINE_BLOCKS} blocks per timeline query, got {len(ids)}")
    if not ids:
        return {}
    with _connection(db) as connection:
        touching = _touches_blocks(connection.dialect, ids)
        statement = (
            select(EVENTS.c.id, EVENTS.c.step, EVENTS.c.time, EVENTS.c.kind, EVENTS.c.request_id, EVENTS.c.block_id, EVENTS.c.detail)
            .where(
                EVENTS.c.run_id == run_id,
                EVENTS.c.kind.in_(block_history.BLOCK_KINDS),
                EVENTS.c.detail["group"].as_string() == group,
                touching,
            )
            .order_by(EVENTS.c.id)
        )
        events = [StoredEvent(*row) for row in connection.execute(statement).all()]
    lives = block_history.replay(events, ids)
    timelines = {}
    for block_id, life in lives.items():
        changes = life.rows if request_ids is None else block_history.rows_involving(life, request_ids)
        rows = pd.DataFrame([change.values() for change in changes], columns=list(HISTORY_COLUMNS))
        timelines[block_id] = BlockTimeline(run_id, group, block_id, rows, life.complete)
    return timelines


def block_timeline(db: Readable, block_id: int, run_id: str | None = None, group: str = "full") -> BlockTimeline | None:
    """One block's history in `run_id` (default: the newest run); None when the history has no run."""
    run_id = run_id or latest_run_id(db)
    if run_id is None:
        return None
    return block_timelines(db, run_id, [block_id], group)[int(block_id)]


def _touches_blocks(dialect: Dialect, ids: list[int]) -> ColumnElement[bool]:
    """Events that name one of `ids`: as block_id (EVICT, a COW's copy, a call's first block), as a COW's
    source, or in the `block_ids` list of their detail (read with each backend's JSON set function)."""
    if dialect.name == "postgresql":
        elements = func.json_array_elements_text(EVENTS.c.detail["block_ids"]).table_valued("value")
        listed = select(elements.c.value).where(elements.c.value.in_([str(i) for i in ids])).exists()
    else:
        elements = func.json_each(EVENTS.c.detail, "$.block_ids").table_valued("value")
        listed = select(elements.c.value).where(elements.c.value.in_(ids)).exists()
    return or_(EVENTS.c.block_id.in_(ids), EVENTS.c.detail["src_block"].as_integer().in_(ids), listed)


def request_blocks(db: Readable, run_id: str, request_ids: Sequence[str], group: str = "full") -> list[int]:
    """The blocks these requests ever held in `group` (allocated, shared by a hit or a fork, copied), in
    the order they first took them."""
    kinds = (block_history.ALLOCATE, block_history.HIT, block_history.FORK, block_history.COW)
    statement = (
        select(EVENTS.c.kind, EVENTS.c.detail)
        .where(
            EVENTS.c.request_id.in_(list(request_ids)),
            EVENTS.c.run_id == run_id,
            EVENTS.c.kind.in_(kinds),
            EVENTS.c.detail["group"].as_string() == group,
        )
        .order_by(EVENTS.c.id)
    )
    with _connection(db) as connection:
        found: dict[int, None] = {}
        for kind, detail in connection.execute(statement).all():
            ids = [detail.get("dst_block")] if kind == block_history.COW else detail.get("block_ids") or []
            found.update(dict.fromkeys(int(i) for i in ids if i is not None))
    return list(found)


def fork_family(db: Readable, run_id: str, request_id: str) -> list[str]:
    """`request_id`'s fork family in `run_id`: its oldest recorded ancestor, then every descendant,
    generation by generation, by arrival (at most MAX_FAMILY requests)."""
    with _connection(db) as connection:
        root, seen = request_id, {request_id}
        while True:
            parent = connection.scalar(
                select(REQUESTS.c.parent_id).where(REQUESTS.c.run_id == run_id, REQUESTS.c.request_id == root)
            )
            if parent is None or parent in seen:
                break
            root = parent
            seen.add(root)
        family, generation = [root], [root]
        while generation and len(family) < MAX_FAMILY:
            statement = (
                select(REQUESTS.c.request_id)
                .where(REQUESTS.c.run_id == run_id, REQUESTS.c.parent_id.in_(generation))
                .order_by(REQUESTS.c.arrival_time, REQUESTS.c.request_id)
            )
            generation = [rid for rid in connection.scalars(statement).all() if rid not in family]
            family += generation
    return family[:MAX_FAMILY]
