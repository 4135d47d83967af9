"""One batch of the writer's queue, written in one transaction: the items, and the statements they become.

`Item` is the unit the writer queues and the unit of atomicity: its rows are written whole or not at all.
`write_batch` writes a batch's items, the runs they need and the runs' stop times on one connection (the
caller's transaction); `is_transient` says which failures are worth another try.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, update
from sqlalchemy.exc import DBAPIError, OperationalError

from engine.core.snapshot import RequestView
from storage.schema import (
    EVICTION_ROW_COLUMNS, EVICTIONS, INTERRUPTED_STATUS, OPEN_STATUSES, REQUESTS, RUN_COLUMNS, RUNS,
    TIER_MOVE_COLUMNS, TIER_MOVES, RunEnd,
)  # fmt: skip
from storage.write import bulk, rollups, run_liveness
from storage.write.rows import EncodedEvents, eviction_values, tier_move_values
from storage.write.writer_types import RowWriter

# (run_id, time, reason, age_s, hit_count) of an eviction row, as rollups.eviction_deltas takes them.
_ROLLUP_FIELDS = operator.itemgetter(
    *(EVICTION_ROW_COLUMNS.index(name) for name in ("run_id", "time", "reason", "age_s", "hit_count"))
)


@dataclass(frozen=True)
class Item:
    """One unit of the queue, written whole or not at all. An empty item only wakes the thread."""

    seq: int  # order of submission; `mark` and `wait` name it
    run_id: str | None = None  # the run its rows belong to
    events: EncodedEvents | None = None  # at most `item_rows` events, written in one transaction
    requests: tuple[RequestView, ...] = ()
    rows: Any = None  # another producer's row set (`submit_rows`), written by `write_rows`
    write_rows: RowWriter | None = None  # its bulk function
    num_other: int = 0  # rows in `rows`, as its producer counts them

    @property
    def num_events(self) -> int:
        return 0 if self.events is None else self.events.count

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_rows(self) -> int:
        return self.num_events + self.num_requests + self.num_other


Stops = dict[str, tuple[float, RunEnd]]  # run id -> (stopped_at, how it ended)


def write_batch(connection: Connection, items: list[Item], runs: dict[str, dict[str, Any]], stops: Stops) -> None:
    """Insert the `runs` not in the table yet (closing other runs whose owner died: storage.write.run_liveness),
    the items' rows, and the `stops`."""
    if runs:
        now = time.time()
        _insert_runs(connection, runs, now)
        run_liveness.close_interrupted_runs(connection, now, keep=runs.keys())
    _insert_rows(connection, items)
    _stop_runs(connection, stops)


def is_transient(error: Exception) -> bool:
    """Locked, busy, read-only, unreachable: worth another try. Bad data is not."""
    if isinstance(error, OperationalError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


def _insert_runs(connection: Connection, runs: dict[str, dict[str, Any]], now: float) -> None:
    """Insert the pending runs that are not in the table yet (a commit may have been lost), alive `now`."""
    rows = [tuple({**row, "heartbeat_at": now}[name] for name in RUN_COLUMNS) for row in runs.values()]
    bulk.insert_new_rows(connection, RUNS, RUN_COLUMNS, rows)


def _insert_rows(connection: Connection, items: list[Item]) -> None:
    """The rows of a batch: each run's events, evictions (with their rollups) and tier moves, then the latest
    view of every request."""
    parts_by_run: dict[str, list[EncodedEvents]] = {}  # each run's events, in item order
    for item in items:
        if item.events is not None:
            parts_by_run.setdefault(item.run_id, []).append(item.events)
    for run_id, parts in parts_by_run.items():
        bulk.insert_events(connection, run_id, parts)
        evictions = [eviction_values(run_id, event) for part in parts for event in part.evictions]
        if evictions:
            bulk.insert_rows(connection, EVICTIONS, EVICTION_ROW_COLUMNS, evictions)
            rollups.add_evictions(connection, rollups.eviction_deltas(map(_ROLLUP_FIELDS, evictions)))
        moves = [row for part in parts for event in part.tier_moves for row in tier_move_values(run_id, event)]
        if moves:
            bulk.insert_rows(connection, TIER_MOVES, TIER_MOVE_COLUMNS, moves)
    latest = {(item.run_id, view.request_id): view for item in items for view in item.requests}
    views_by_run: dict[str, list[RequestView]] = {}
    for (run_id, _), view in latest.items():
        views_by_run.setdefault(run_id, []).append(view)
    for run_id, views in views_by_run.items():
        bulk.upsert_views(connection, run_id, views)
    row_sets: dict[RowWriter, list[Any]] = {}  # other producers' rows, by bulk function, in item order
    for item in items:
        if item.write_rows is not None:
            row_sets.setdefault(item.write_rows, []).append(item.rows)
    for write, sets in row_sets.items():
        write(connection, sets)


def _stop_runs(connection: Connection, stops: Stops) -> None:
    """End the runs; an interrupted one's open requests are closed too (its engine died with them)."""
    for run_id, (stopped_at, end) in stops.items():
        connection.execute(update(RUNS).where(RUNS.c.id == run_id).values(stopped_at=stopped_at, end_reason=end.value))
        if end is RunEnd.INTERRUPTED:
            connection.execute(
                update(REQUESTS)
                .where(REQUESTS.c.run_id == run_id, REQUESTS.c.status.in_(OPEN_STATUSES))
                .values(status=INTERRUPTED_STATUS)
            )
