"""Bulk writes of a batch's rows, one function per kind of row, each choosing its dialect's fastest path.

    insert_events(connection, run_id, parts)      `events` rows of one run (`encode_events` parts, in order)
    insert_rows(connection, table, columns, rows) driver-ready row tuples (storage.write.rows), e.g. evictions
    insert_new_rows(connection, table, columns, rows)   the same, skipping rows whose key is present
    upsert_views(connection, run_id, views)       `requests` rows of one run's views, by (run_id, request_id)

SQLite: one statement over a JSON array per call (storage.write.bulk_sqlite). PostgreSQL: COPY through psycopg
and INSERT ... ON CONFLICT (storage.write.bulk_postgres). Any other database: executemany of the statements
SQLAlchemy compiles from `insert(table)`, and an upsert that deletes, then inserts. The insert paths skip
SQLAlchemy's per-row parameter processing everywhere: it cost more than SQLite's own insert.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table, insert, select, tuple_

from engine.core.snapshot import RequestView
from storage.write import bulk_postgres, bulk_sqlite
from storage.schema import EVENT_COLUMNS, EVENTS, REQUEST_KEY, REQUESTS
from storage.write.rows import EncodedEvents, decode_events, event_values, join_encoded, request_row


def insert_events(connection: Connection, run_id: str, parts: Sequence[EncodedEvents]) -> None:
    """Insert the events of one run, `parts` in order."""
    if connection.dialect.name == "sqlite":
        bulk_sqlite.insert_event_array(connection, run_id, join_encoded(parts).json)
        return
    rows = [event_values(run_id, event) for part in parts for event in decode_events(part)]
    insert_rows(connection, EVENTS, EVENT_COLUMNS, rows)


def insert_rows(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """Insert `rows`: driver-ready values in `columns` order."""
    if connection.dialect.name == "sqlite":
        bulk_sqlite.insert_rows(connection, table, columns, rows)
    elif connection.dialect.driver == "psycopg":
        bulk_postgres.copy_rows(connection, table, columns, rows)
    else:
        _executemany(connection, table, columns, rows)


def insert_new_rows(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """Insert the row tuples whose primary key is not in `table` yet; rows already there stay as they are.

    SQLite: one INSERT ... ON CONFLICT DO NOTHING over a JSON array, which returns nothing. Elsewhere a
    SELECT of the present keys, then an insert of the rest (on PostgreSQL a multi-row INSERT ... ON
    CONFLICT, compiled anew for every row count, measured no faster).
    """
    if connection.dialect.name == "sqlite":
        bulk_sqlite.insert_new_rows(connection, table, columns, rows)
        return
    (key,) = table.primary_key.columns  # one-column keys only (fleet_sources.id)
    position = list(columns).index(key.name)
    present = set(connection.scalars(select(key).where(key.in_([row[position] for row in rows]))))
    missing = [dict(zip(columns, row)) for row in rows if row[position] not in present]
    if missing:
        connection.execute(insert(table), missing)


def upsert_views(connection: Connection, run_id: str, views: list[RequestView]) -> None:
    """Insert or replace the `requests` rows of one run's views (distinct requests)."""
    if connection.dialect.name == "sqlite":
        bulk_sqlite.upsert_views(connection, run_id, views)
        return
    rows = [request_row(run_id, view) for view in views]
    if connection.dialect.name == "postgresql":
        bulk_postgres.upsert_rows(connection, rows)
        return
    keys = [tuple(row[name] for name in REQUEST_KEY) for row in rows]
    connection.execute(REQUESTS.delete().where(tuple_(*(REQUESTS.c[name] for name in REQUEST_KEY)).in_(keys)))
    connection.execute(insert(REQUESTS), rows)


def _executemany(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """The statement SQLAlchemy compiles for `insert(table)`, run by the driver on the row tuples as they are."""
    compiled = insert(table).inline().compile(dialect=connection.dialect, column_keys=list(columns))
    if not compiled.positional:
        parameters: list[Any] = [dict(zip(columns, row, strict=True)) for row in rows]
    elif tuple(compiled.positiontup) == tuple(columns):
        parameters = rows
    else:
        order = [columns.index(name) for name in compiled.positiontup]
        parameters = [tuple(row[index] for index in order) for row in rows]
    connection.exec_driver_sql(compiled.string, parameters)
