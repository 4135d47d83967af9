"""Per-minute eviction aggregates (`eviction_rollups`), kept equal to the eviction log they summarise.

The writer adds the deltas of the rows it inserts, in the same transaction (`add_evictions`);
retention rebuilds the minutes whose rows it deleted, in the same transaction (`rebuild`). So after
every commit, each rollup row is exactly the aggregate of the `evictions` rows with its key, and the
eviction charts can read rollups instead of scanning the log.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, and_, bindparam, case, delete, func, insert, select, update

from storage.buckets import bucket_index
from storage.schema import AGE_BIN_COLUMNS, AGE_EDGES_S, EVICTIONS, HIT_BIN_COLUMNS, HIT_EDGES, ROLLUP_SECONDS, ROLLUPS

KEY_COLUMNS = ("run_id", "minute", "reason")
COUNT_COLUMNS = ("evictions", *AGE_BIN_COLUMNS, *HIT_BIN_COLUMNS)

RollupKey = tuple[str, int, str]  # (run_id, minute, reason)


def minute_of(time: float) -> int:
    """The rollup minute of an epoch time, computed as the SQL side computes it."""
    return math.floor(time / ROLLUP_SECONDS)


def eviction_deltas(rows: Iterable[tuple[str, float, str, float | None, int | None]]) -> dict[RollupKey, list[int]]:
    """Aggregate (run_id, time, reason, age_s, hit_count) rows into counts per rollup key.

    Returns:
        key -> counts in COUNT_COLUMNS order.
    """
    deltas: dict[RollupKey, list[int]] = {}
    age_offset = 1
    hit_offset = 1 + len(AGE_BIN_COLUMNS)
    for run_id, time, reason, age_s, hit_count in rows:
        key = (run_id, minute_of(time), reason)
        counts = deltas.get(key)
        if counts is None:
            counts = deltas[key] = [0] * len(COUNT_COLUMNS)
        counts[0] += 1
        if age_s is not None:
            counts[age_offset + bisect_right(AGE_EDGES_S, age_s)] += 1
        if hit_count is not None:
            counts[hit_offset + bisect_right(HIT_EDGES, hit_count)] += 1
    return deltas


def add_evictions(connection: Connection, deltas: dict[RollupKey, list[int]]) -> None:
    """Add counts to their rollup rows, creating missing rows (one writer per run, so no race)."""
    if not deltas:
        return
    minutes = [minute for _run, minute, _reason in deltas]
    existing = {
        tuple(row)
        for row in connection.execute(
            select(ROLLUPS.c.run_id, ROLLUPS.c.minute, ROLLUPS.c.reason).where(
                ROLLUPS.c.run_id.in_({run_id for run_id, _minute, _reason in deltas}),
                ROLLUPS.c.minute.between(min(minutes), max(minutes)),
            )
        )
    }
    increments = [
        {"key_run_id": key[0], "key_minute": key[1], "key_reason": key[2], **_named(counts, "add_")}
        for key, counts in deltas.items()
        if key in existing
    ]
    if increments:
        statement = (
            update(ROLLUPS)
            .where(*(ROLLUPS.c[name] == bindparam(f"key_{name}") for name in KEY_COLUMNS))
            .values({name: ROLLUPS.c[name] + bindparam(f"add_{name}") for name in COUNT_COLUMNS})
        )
        connection.execute(statement, increments)
    new_rows = [
        dict(zip(KEY_COLUMNS, key, strict=True), **_named(counts))
        for key, counts in deltas.items()
        if key not in existing
    ]
    if new_rows:
        connection.execute(insert(ROLLUPS), new_rows)


def _named(counts: list[int], prefix: str = "") -> dict[str, int]:
    return {prefix + name: count for name, count in zip(COUNT_COLUMNS, counts, strict=True)}


def rebuild(connection: Connection, first_minute: int, last_minute: int) -> None:
    """Recompute the rollup rows of minutes [first_minute, last_minute] from the evictions table."""
    connection.execute(delete(ROLLUPS).where(ROLLUPS.c.minute.between(first_minute, last_minute)))
    minute = bucket_index(connection.dialect, EVICTIONS.c.time, ROLLUP_SECONDS)
    in_range = and_(
        minute.between(first_minute, last_minute),
        # Loose time bounds only let the time index narrow the scan; the minute test decides.
        EVICTIONS.c.time >= (first_minute - 1) * ROLLUP_SECONDS,
        EVICTIONS.c.time < (last_minute + 2) * ROLLUP_SECONDS,
    )
    connection.execute(
        insert(ROLLUPS).from_select([*KEY_COLUMNS, *COUNT_COLUMNS], _aggregate_select(connection, in_range))
    )


def _aggregate_select(connection: Connection, condition) -> Any:
    """SELECT run_id, minute, reason, *COUNT_COLUMNS FROM evictions WHERE condition GROUP BY key."""
    minute = bucket_index(connection.dialect, EVICTIONS.c.time, ROLLUP_SECONDS)
    rows = (
        select(
            EVICTIONS.c.run_id,
            minute.label("minute"),
            EVICTIONS.c.reason,
            *_bin_flags(EVICTIONS.c.age_s, AGE_EDGES_S, AGE_BIN_COLUMNS),
            *_bin_flags(EVICTIONS.c.hit_count, HIT_EDGES, HIT_BIN_COLUMNS),
        )
        .where(condition)
        .subquery()
    )
    return select(
        rows.c.run_id,
        rows.c.minute,
        rows.c.reason,
        func.count().label("evictions"),
        *(func.sum(rows.c[name]).label(name) for name in (*AGE_BIN_COLUMNS, *HIT_BIN_COLUMNS)),
    ).group_by(rows.c.run_id, rows.c.minute, rows.c.reason)


def _bin_flags(column, edges: Sequence[float], names: Sequence[str]) -> list:
    """One 0/1 column per bin: 1 where `column` falls in that bin (all 0 where it is NULL)."""
    flags = []
    for index, name in enumerate(names):
        inside = [column >= edges[index - 1] if index else column.is_not(None)]
        if index < len(edges):
            inside.append(column < edges[index])
        flags.append(case((and_(*inside), 1), else_=0).label(name))
    return flags
