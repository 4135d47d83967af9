"""Keep the history bounded: by age and by row count, oldest rows first.

Invariants:
    * Only rows older than the age limit, or beyond the newest `max_*` rows (by id, i.e. insertion
      order), are deleted; runs are never deleted. A `writer_progress` row goes once its writer has not
      committed for that long (a writer that is still running saves it again with its next commit).
    * Deleting evictions keeps `eviction_rollups` equal to the log (see storage.write.rollups).
    * Deletions run in chunks of `chunk_rows`, one short transaction each, so readers and the next
      write batch never wait behind one huge delete.
    * Every (table, reason) that lost rows in a pruning run gets one `prunes` row; runs that delete
      nothing leave no trace (the log stays about deletions, not about the clock).
    * Fleet history: fleet_events, fleet_evictions and fleet_metrics by age (source by source, through
      their (source_id, time) indexes) and by count; fleet_blocks (what sources hold now) only for sources
      closed longer ago than the age limit, so a watched pod's blocks are never pruned; sources are
      never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, Engine, Table, delete, func, insert, select, tuple_

from storage.write import rollups
from storage.schema import (
    EVENTS,
    EVICTIONS,
    FLEET_BLOCKS,
    FLEET_EVENTS,
    FLEET_EVICTIONS,
    FLEET_METRICS,
    FLEET_SOURCES,
    PROGRESS,
    PRUNES,
    REQUESTS,
    TIER_MOVES,
)

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class RetentionPolicy:
    """How much history to keep. None disables a bound."""

    max_age_days: float | None = 30.0  # events, evictions, tier moves, requests, prune logs, idle writers' progress
    max_events: int | None = 5_000_000  # newest events rows kept
    max_evictions: int | None = 1_000_000  # newest evictions rows kept
    max_tier_moves: int | None = 1_000_000  # newest tier_moves rows kept
    max_fleet_events: int | None = 5_000_000  # newest fleet_events rows kept (max_age_days applies too)
    max_fleet_evictions: int | None = 5_000_000  # newest fleet_evictions rows kept
    max_fleet_metrics: int | None = 1_000_000  # newest fleet_metrics rows kept (a row per pod per scrape)
    chunk_rows: int = 50_000  # rows deleted per transaction


@dataclass(frozen=True)
class PruneResult:
    table_name: str
    reason: str  # "age" | "max_rows"
    rows_deleted: int


def prune(engine: Engine, policy: RetentionPolicy, now: float) -> list[PruneResult]:
    """Apply `policy` as of `now` (epoch seconds) and log what was deleted.

    Returns:
        One result per (table, reason) that deleted at least one row.
    """
    results: list[PruneResult] = []
    if policy.max_age_days is not None:
        cutoff = now - policy.max_age_days * SECONDS_PER_DAY
        aged = (
            (EVENTS, EVENTS.c.time),
            (EVICTIONS, EVICTIONS.c.time),
            (TIER_MOVES, TIER_MOVES.c.time),
            (REQUESTS, REQUESTS.c.arrival_time),
            (PRUNES, PRUNES.c.time),
            (PROGRESS, PROGRESS.c.updated_at),
        )
        for table, time_column in aged:
            deleted = _delete_chunked(engine, table, time_column < cutoff, time_column, policy.chunk_rows)
            results.append(PruneResult(table.name, "age", deleted))
    bounded = (
        (EVENTS, policy.max_events),
        (EVICTIONS, policy.max_evictions),
        (TIER_MOVES, policy.max_tier_moves),
        (FLEET_EVENTS, policy.max_fleet_events),
        (FLEET_EVICTIONS, policy.max_fleet_evictions),
        (FLEET_METRICS, policy.max_fleet_metrics),
    )
    for table, max_rows in bounded:
        if max_rows is not None:
            results.append(PruneResult(table.name, "max_rows", _delete_beyond(engine, table, max_rows, policy)))
    results.extend(_prune_fleet_by_source(engine, policy, now))
    results = [result for result in results if result.rows_deleted]
    if results:
        with engine.begin() as connection:
            connection.execute(
                insert(PRUNES),
                [
                    {"time": now, "table_name": r.table_name, "reason": r.reason, "rows_deleted": r.rows_deleted}
                    for r in results
                ],
            )
    return results


def _prune_fleet_by_source(engine: Engine, policy: RetentionPolicy, now: float) -> list[PruneResult]:
    """Fleet events, evictions and metrics older than the age limit, and the held blocks of sources closed
    before it."""
    if policy.max_age_days is None:
        return []
    cutoff = now - policy.max_age_days * SECONDS_PER_DAY
    with engine.connect() as connection:
        sources = connection.execute(select(FLEET_SOURCES.c.id, FLEET_SOURCES.c.closed_at)).all()
    aged = (
        (FLEET_EVENTS, FLEET_EVENTS.c.ts),
        (FLEET_EVICTIONS, FLEET_EVICTIONS.c.time),
        (FLEET_METRICS, FLEET_METRICS.c.at),
    )
    deleted = {FLEET_EVENTS.name: 0, FLEET_EVICTIONS.name: 0, FLEET_METRICS.name: 0, FLEET_BLOCKS.name: 0}
    for source, closed_at in sources:
        for table, time_column in aged:
            condition = (table.c.source_id == source) & (time_column < cutoff)
            deleted[table.name] += _delete_chunked(engine, table, condition, time_column, policy.chunk_rows)
        if closed_at is not None and closed_at < cutoff:
            held = FLEET_BLOCKS.c.source_id == source
            deleted[FLEET_BLOCKS.name] += _delete_chunked(engine, FLEET_BLOCKS, held, FLEET_BLOCKS.c.n, policy.chunk_rows)
    return [PruneResult(table, "age", rows) for table, rows in deleted.items()]


def _delete_beyond(engine: Engine, table: Table, max_rows: int, policy: RetentionPolicy) -> int:
    """Delete all but the newest `max_rows` rows of `table` (by id)."""
    with engine.connect() as connection:
        newest_dropped_id = connection.scalar(select(table.c.id).order_by(table.c.id.desc()).offset(max_rows).limit(1))
    if newest_dropped_id is None:
        return 0
    return _delete_chunked(engine, table, table.c.id <= newest_dropped_id, table.c.id, policy.chunk_rows)


def _delete_chunked(
    engine: Engine, table: Table, condition: ColumnElement[bool], order: ColumnElement, chunk_rows: int
) -> int:
    """Delete the rows matching `condition` in `order` (an indexed column of the condition, so an
    empty match costs an index probe, not a scan), `chunk_rows` per transaction.

    Eviction chunks also rebuild the rollup minutes they touched, in the same transaction.
    """
    key = tuple_(*table.primary_key.columns)
    total = 0
    while True:
        chunk = select(*table.primary_key.columns).where(condition).order_by(order).limit(chunk_rows)
        with engine.begin() as connection:
            if table is EVICTIONS:
                first, last = connection.execute(
                    select(func.min(EVICTIONS.c.time), func.max(EVICTIONS.c.time)).where(key.in_(chunk))
                ).one()
            deleted = connection.execute(delete(table).where(key.in_(chunk))).rowcount
            if table is EVICTIONS and deleted:
                rollups.rebuild(connection, rollups.minute_of(first), rollups.minute_of(last))
        total += deleted
        if deleted < chunk_rows:
            return total
