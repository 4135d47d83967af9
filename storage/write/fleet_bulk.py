"""Bulk writes of the fleet tables: the `storage.write.writer.RowWriter` of the fleet sink.

    write_fleet_rows(connection, units)    every `FleetRows` of one writer batch, in one transaction

Inserts go through storage.write.bulk (SQLite: one statement over a JSON array per table; PostgreSQL: COPY).
The rows hold their JSON columns (hash lists, token ids) as Python lists; each is encoded to its JSON text
on its own first, on every dialect. On SQLite the rows' JSON array then carries that text as a string:
nested as an array, it made SQLite parse it and render it again for every json_extract of the row (SQLite
3.40 keeps no parsed JSON), and a fleet_blocks row with its 16 token ids took 11-12 us to insert instead
of 7-9.
Deletes of ended lifetimes go by primary key (source_id, n), one statement per source of the batch: on
PostgreSQL `... WHERE source_id = :source AND n = ANY(:ns)`, an index scan (a second array, of the
sources, unnested beside the numbers cost the driver more than the server spent deleting); on SQLite
`... AND n IN (SELECT value FROM json_each(:ns))`, a key search per number (a row-value IN over one
json_each of (source, n) pairs scanned the whole source instead). Row by row, executemany released and
took back the GIL for every row, and each time waited behind the collector's threads: 4.2 s of the
writer thread's wall time for 1.6 s of its CPU on the fleet benchmark's SQLite runs. Other dialects
delete row by row (executemany, SQLAlchemy's per-row parameter processing skipped, as storage.write.bulk
does). Copies changes (duplicated blocks only), source closes and source statuses (the latest of each
source in the batch) are executemany.

Order inside the transaction: the sources a unit needs (inserted unless present, as the writer does for
runs, so a unit never waits on an earlier one that was lost), the inserts, the copies changes, then the
deletes: a change or delete always finds the rows of earlier units of the batch, and changes are
absolute (the last one of a lifetime is its state).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sqlalchemy import (
    JSON,
    BigInteger,
    Connection,
    Delete,
    String,
    Table,
    Update,
    any_,
    bindparam,
    delete,
    func,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from storage.write import bulk
from storage.db import encode_json
from storage.write.fleet_rows import FleetRows
from storage.schema import (
    FLEET_BLOCK_COLUMNS,
    FLEET_BLOCKS,
    FLEET_EVENT_COLUMNS,
    FLEET_EVENTS,
    FLEET_EVICTION_COLUMNS,
    FLEET_EVICTIONS,
    FLEET_METRICS,
    FLEET_METRICS_COLUMNS,
    FLEET_SOURCE_COLUMNS,
    FLEET_SOURCE_STATUS_COLUMNS,
    FLEET_SOURCES,
)


def write_fleet_rows(connection: Connection, units: Sequence[FleetRows]) -> None:
    """Write the rows of `units` (in order) on `connection`, inside its transaction."""
    _ensure_sources(connection, {row[0]: row for unit in units for row in unit.sources})
    for table, columns, rows in (
        (FLEET_BLOCKS, FLEET_BLOCK_COLUMNS, [row for unit in units for row in unit.opened.values()]),
        (FLEET_EVENTS, FLEET_EVENT_COLUMNS, [row for unit in units for row in unit.events]),
        (FLEET_EVICTIONS, FLEET_EVICTION_COLUMNS, [row for unit in units for row in unit.evictions]),
        (FLEET_METRICS, FLEET_METRICS_COLUMNS, [row for unit in units for row in unit.metrics]),
    ):
        if not rows:
            continue
        bulk.insert_rows(connection, table, columns, _json_encoded(table, columns, rows))
    changes = {(source, n): copies for unit in units for source, n, copies in unit.changed}
    if changes:
        values = [{"key_source": s, "key_n": n, "new_copies": copies} for (s, n), copies in changes.items()]
        connection.execute(_change_statement(), values)
    ended = [row for unit in units for row in unit.ended]
    if ended:
        _delete_held(connection, ended)
    below = [{"key_source": source, "key_n": n} for unit in units for source, n in unit.ended_below]
    if below:
        connection.execute(_delete_below_statement(), below)
    closes = [{"key_source": source, "closed": at} for unit in units for source, at in unit.source_closes]
    if closes:
        statement = update(FLEET_SOURCES).where(FLEET_SOURCES.c.id == bindparam("key_source"))
        connection.execute(statement.values(closed_at=bindparam("closed")), closes)
    statuses = {row[0]: row for unit in units for row in unit.statuses}  # the latest per source
    if statuses:
        names = ("key_source", *FLEET_SOURCE_STATUS_COLUMNS)
        connection.execute(_status_statement(), [dict(zip(names, row)) for row in statuses.values()])


def _json_encoded(table: Table, columns: Sequence[str], rows: list[list]) -> list[list]:
    """`rows` with their JSON columns' lists encoded as JSON text."""
    positions = [i for i, name in enumerate(columns) if isinstance(table.c[name].type, JSON)]
    if not positions:
        return rows
    encoded = []
    for row in rows:
        row = list(row)
        for i in positions:
            if row[i] is not None:
                row[i] = encode_json(row[i])
        encoded.append(row)
    return encoded


def _ensure_sources(connection: Connection, rows: dict[str, tuple]) -> None:
    """Insert the source rows that are not in the table yet (an earlier unit may have been lost)."""
    if rows:
        bulk.insert_new_rows(connection, FLEET_SOURCES, FLEET_SOURCE_COLUMNS, list(rows.values()))


def _delete_held(connection: Connection, keys: list[tuple]) -> None:
    """Delete fleet_blocks rows by (source_id, n): one statement per source on PostgreSQL and SQLite."""
    dialect = connection.dialect.name
    if dialect not in ("postgresql", "sqlite"):
        _driver_executemany(connection, _portable_delete_statement(), ("key_source", "key_n"), keys)
        return
    by_source: dict[str, list[int]] = {}
    for source, n in keys:
        by_source.setdefault(source, []).append(n)
    if dialect == "postgresql":
        parameters = [{"key_source": source, "key_ns": ns} for source, ns in by_source.items()]
        connection.execute(_postgres_delete_statement(), parameters)
    else:
        parameters = [{"key_source": source, "key_ns": encode_json(ns)} for source, ns in by_source.items()]
        connection.execute(_sqlite_delete_statement(), parameters)


def _driver_executemany(connection: Connection, statement, names: tuple[str, ...], rows: list[tuple]) -> None:
    """`statement` compiled for the connection's dialect, run by the driver on row tuples (values of the
    bound parameters `names`, in that order)."""
    compiled = statement.compile(dialect=connection.dialect)
    if compiled.positional:
        order = [names.index(name) for name in compiled.positiontup]
        parameters: list = rows if order == list(range(len(names))) else [tuple(row[i] for i in order) for row in rows]
    else:
        parameters = [dict(zip(names, row)) for row in rows]
    connection.exec_driver_sql(compiled.string, parameters)


@functools.cache
def _postgres_delete_statement() -> Delete:
    """One source's rows by their numbers: `n = ANY(:key_ns)`, an index scan of the primary key."""
    blocks = FLEET_BLOCKS.c
    numbers = bindparam("key_ns", type_=ARRAY(BigInteger))
    return delete(FLEET_BLOCKS).where(blocks.source_id == bindparam("key_source"), blocks.n == any_(numbers))


@functools.cache
def _sqlite_delete_statement() -> Delete:
    """One source's rows by their numbers, given as a JSON array: `n IN (SELECT value FROM json_each(:key_ns))`,
    a search of the primary key per number inside one statement (the GIL is released for all of it)."""
    blocks = FLEET_BLOCKS.c
    numbers = func.json_each(bindparam("key_ns", type_=String)).table_valued("value")
    where = (blocks.source_id == bindparam("key_source")) & blocks.n.in_(select(numbers.c.value))
    return delete(FLEET_BLOCKS).where(where)


@functools.cache
def _portable_delete_statement() -> Delete:
    blocks = FLEET_BLOCKS.c
    return delete(FLEET_BLOCKS).where(blocks.source_id == bindparam("key_source"), blocks.n == bindparam("key_n"))


@functools.cache
def _change_statement() -> Update:
    blocks = FLEET_BLOCKS.c
    return (
        update(FLEET_BLOCKS)
        .where(blocks.source_id == bindparam("key_source"), blocks.n == bindparam("key_n"))
        .values(copies=bindparam("new_copies"))
    )


@functools.cache
def _delete_below_statement() -> Delete:
    """Every held row of a source numbered below n (a clear or a reset)."""
    blocks = FLEET_BLOCKS.c
    return delete(FLEET_BLOCKS).where(blocks.source_id == bindparam("key_source"), blocks.n < bindparam("key_n"))


@functools.cache
def _status_statement() -> Update:
    """A source's latest PodStatus: its link, heartbeat, lost batches and restarts."""
    values = {name: bindparam(name) for name in FLEET_SOURCE_STATUS_COLUMNS}
    return update(FLEET_SOURCES).where(FLEET_SOURCES.c.id == bindparam("key_source")).values(**values)
