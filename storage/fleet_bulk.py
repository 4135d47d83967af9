"""Bulk writes of the fleet tables: the `storage.writer.RowWriter` of the fleet sink.

    write_fleet_rows(connection, units)    every `FleetRows` of one writer batch, in one transaction

Inserts go through storage.bulk (SQLite: one statement over a JSON array per table; PostgreSQL: COPY).
Lifetime changes (copies, end) are one UPDATE per batch: on SQLite `UPDATE ... FROM json_each(:rows)`,
on PostgreSQL `UPDATE ... FROM unnest(:sources, :ns, :copies, :times, :reasons)`, elsewhere executemany;
each probes the primary key (source_id, n). Changes are absolute values, so of several changes of one
lifetime in a batch only the last is written (an UPDATE ... FROM joining two rows to one target would
apply either). Order inside the transaction: the sources a unit needs (inserted unless
present, as the writer does for runs, so a unit never waits on an earlier one that was lost), then the
inserts, then the updates, so an update always finds the lifetimes of earlier units of the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sqlalchemy import (
    BigInteger,
    Connection,
    Double,
    Integer,
    String,
    Update,
    and_,
    bindparam,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from storage import bulk
from storage.db import encode_json
from storage.fleet_rows import FleetRows
from storage.models import (
    FLEET_BLOCK_COLUMNS,
    FLEET_BLOCKS,
    FLEET_EVENT_COLUMNS,
    FLEET_EVENTS,
    FLEET_EVICTION_COLUMNS,
    FLEET_EVICTIONS,
    FLEET_SOURCE_COLUMNS,
    FLEET_SOURCES,
)

# Bound names of a lifetime change's values (a bound name may not be a column name in an UPDATE).
_CHANGE_PARAMETERS = ("change_source", "change_n", "change_copies", "change_at", "change_reason")
_END_BELOW_PARAMETERS = ("change_source", "change_n", "change_at", "change_reason")


def write_fleet_rows(connection: Connection, units: Sequence[FleetRows]) -> None:
    """Write the rows of `units` (in order) on `connection`, inside its transaction."""
    _ensure_sources(connection, {row[0]: row for unit in units for row in unit.sources})
    for table, columns, name in (
        (FLEET_BLOCKS, FLEET_BLOCK_COLUMNS, "opened"),
        (FLEET_EVENTS, FLEET_EVENT_COLUMNS, "events"),
        (FLEET_EVICTIONS, FLEET_EVICTION_COLUMNS, "evictions"),
    ):
        rows = [tuple(row) for unit in units for row in getattr(unit, name)]
        if rows:
            bulk.insert_rows(connection, table, columns, rows)
    latest = {(row[0], row[1]): row for unit in units for row in unit.changed}
    if latest:
        _change_lifetimes(connection, list(latest.values()))
    below = [dict(zip(_END_BELOW_PARAMETERS, row)) for unit in units for row in unit.ended_below]
    if below:
        connection.execute(_end_below_statement(), below)
    closes = [{"source": source, "at": at} for unit in units for source, at in unit.source_closes]
    if closes:
        statement = update(FLEET_SOURCES).where(FLEET_SOURCES.c.id == bindparam("source"))
        connection.execute(statement.values(closed_at=bindparam("at")), closes)


def _ensure_sources(connection: Connection, rows: dict[str, tuple]) -> None:
    """Insert the source rows that are not in the table yet (an earlier unit may have been lost)."""
    if not rows:
        return
    present = set(connection.scalars(select(FLEET_SOURCES.c.id).where(FLEET_SOURCES.c.id.in_(list(rows)))))
    missing = [dict(zip(FLEET_SOURCE_COLUMNS, row)) for source, row in rows.items() if source not in present]
    if missing:
        connection.execute(insert(FLEET_SOURCES), missing)


def _change_lifetimes(connection: Connection, changes: list[tuple]) -> None:
    """Set copies, removed_at and end_reason of lifetimes by (source_id, n) (one change per lifetime)."""
    dialect = connection.dialect.name
    if dialect == "sqlite":
        connection.execute(_sqlite_change_statement(), {"rows": encode_json(changes)})
    elif dialect == "postgresql":
        columns = [list(column) for column in zip(*changes)]
        connection.execute(_postgres_change_statement(), dict(zip(_CHANGE_PARAMETERS, columns)))
    else:
        connection.execute(_portable_change_statement(), [dict(zip(_CHANGE_PARAMETERS, row)) for row in changes])


@functools.cache
def _sqlite_change_statement() -> Update:
    changes = func.json_each(bindparam("rows", type_=String)).table_valued("value")

    def element(index: int):
        return func.json_extract(changes.c.value, f"$[{index}]")

    blocks = FLEET_BLOCKS.c
    return (
        update(FLEET_BLOCKS)
        .where(blocks.source_id == element(0), blocks.n == element(1))
        .values(copies=element(2), removed_at=element(3), end_reason=element(4))
    )


@functools.cache
def _postgres_change_statement() -> Update:
    types = (ARRAY(String), ARRAY(BigInteger), ARRAY(Integer), ARRAY(Double), ARRAY(String))
    arrays = [bindparam(name, type_=kind) for name, kind in zip(_CHANGE_PARAMETERS, types)]
    names = ("source_id", "n", "copies", "removed_at", "end_reason")
    changes = func.unnest(*arrays).table_valued(*names).render_derived("changes")
    blocks = FLEET_BLOCKS.c
    return (
        update(FLEET_BLOCKS)
        .where(blocks.source_id == changes.c.source_id, blocks.n == changes.c.n)
        .values(copies=changes.c.copies, removed_at=changes.c.removed_at, end_reason=changes.c.end_reason)
    )


@functools.cache
def _portable_change_statement() -> Update:
    blocks = FLEET_BLOCKS.c
    return (
        update(FLEET_BLOCKS)
        .where(blocks.source_id == bindparam("change_source"), blocks.n == bindparam("change_n"))
        .values(
            copies=bindparam("change_copies"),
            removed_at=bindparam("change_at"),
            end_reason=bindparam("change_reason"),
        )
    )


@functools.cache
def _end_below_statement() -> Update:
    """End every open lifetime of a source numbered below n (a clear or a reset)."""
    blocks = FLEET_BLOCKS.c
    below = and_(
        blocks.source_id == bindparam("change_source"), blocks.n < bindparam("change_n"), blocks.removed_at.is_(None)
    )
    return (
        update(FLEET_BLOCKS)
        .where(below)
        .values(copies=0, removed_at=bindparam("change_at"), end_reason=bindparam("change_reason"))
    )
