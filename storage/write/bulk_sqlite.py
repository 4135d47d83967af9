"""SQLite bulk writes: all of a table's rows in one statement that reads them from one JSON array.

    INSERT INTO t (columns) SELECT [:run_id,] json_extract(value, '$[0]'), ... FROM json_each(:rows)

The arrays are built in C by orjson (`storage.write.rows.encode_events`, or `encode_json` of row tuples) and
SQLite unpacks them inside a single statement step, during which the sqlite3 module releases the GIL.
Row by row (executemany) the writer held the GIL for every row's conversion and binding, and the engine
thread, whose Python work needs the GIL too, took about three times as long for the steps that
overlapped a batch. Each statement is built once, from SQLAlchemy constructs, and bound with two values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Insert, String, Table, Update, bindparam, func, insert, select, true, update
from sqlalchemy.dialects import sqlite

from engine.core.events import Event
from engine.core.snapshot import RequestView
from storage.db import encode_json
from storage.schema import EVENT_COLUMNS, EVENTS, REQUEST_KEY, REQUESTS
from storage.write.rows import KEY_FIELDS, VIEW_COLUMNS, key_values, view_values


def insert_event_array(connection: Connection, run_id: str, events_json: str) -> None:
    """Insert the `events` rows of one run from a JSON array of Event field arrays (`encode_events`)."""
    connection.execute(_events_statement(), {"run_id": run_id, "rows": events_json})


def insert_rows(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """Insert driver-ready row tuples (values in `columns` order)."""
    connection.execute(_rows_statement(table, tuple(columns)), {"rows": encode_json(rows)})


def insert_new_rows(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """Insert the row tuples whose primary key is not in the table yet (the others are left as they are),
    in one statement that returns nothing: no round trip back through the GIL."""
    connection.execute(_new_rows_statement(table, tuple(columns)), {"rows": encode_json(rows)})


def upsert_views(connection: Connection, run_id: str, views: list[RequestView]) -> None:
    """Insert or replace the `requests` rows of one run's views (distinct requests) by (run_id, request_id).

    JSON cannot carry the finished requests' prompt keys (bytes): those few rows get them from a second
    statement, run by the driver with the bytes bound as BLOBs.
    """
    connection.execute(_views_statement(), {"run_id": run_id, "rows": encode_json(list(map(view_values, views)))})
    keyed = [view for view in views if view.block_keys is not None]
    if keyed:
        parameters = [
            {"key_run_id": run_id, "key_request_id": view.request_id, **dict(zip(KEY_FIELDS, key_values(view)))}
            for view in keyed
        ]
        connection.execute(_keys_statement(), parameters)


@functools.cache
def _events_statement() -> Insert:
    elements = _json_elements()
    # Every column after run_id is the Event field of the same name.
    values = [_element(elements, Event._fields.index(name)) for name in EVENT_COLUMNS[1:]]
    return insert(EVENTS).from_select(EVENT_COLUMNS, select(_run_id(), *values))


@functools.cache
def _keys_statement() -> Update:
    where = (REQUESTS.c.run_id == bindparam("key_run_id")) & (REQUESTS.c.request_id == bindparam("key_request_id"))
    return update(REQUESTS).where(where).values({name: bindparam(name) for name in KEY_FIELDS})


@functools.cache
def _rows_statement(table: Table, columns: tuple[str, ...]) -> Insert:
    elements = _json_elements()
    return insert(table).from_select(columns, select(*(_element(elements, i) for i in range(len(columns)))))


@functools.cache
def _new_rows_statement(table: Table, columns: tuple[str, ...]) -> Insert:
    elements = _json_elements()
    # WHERE true: without it SQLite would read ON CONFLICT as a join constraint of the FROM clause.
    rows = select(*(_element(elements, i) for i in range(len(columns)))).where(true())
    return sqlite.insert(table).from_select(columns, rows).on_conflict_do_nothing()


@functools.cache
def _views_statement() -> Insert:
    elements = _json_elements()
    values = [_element(elements, index) for index in range(len(VIEW_COLUMNS))]
    # WHERE true: without it SQLite would read ON CONFLICT as a join constraint of the FROM clause.
    rows = select(_run_id(), *values).where(true())
    statement = sqlite.insert(REQUESTS).from_select(("run_id", *VIEW_COLUMNS), rows)
    updates = {name: statement.excluded[name] for name in VIEW_COLUMNS if name not in REQUEST_KEY}
    return statement.on_conflict_do_update(index_elements=REQUEST_KEY, set_=updates)


def _json_elements():
    """json_each(:rows): one row per element of the bound JSON array, in its column `value`."""
    return func.json_each(bindparam("rows", type_=String)).table_valued("value")


def _element(elements, index: int):
    return func.json_extract(elements.c.value, f"$[{index}]")


def _run_id():
    return bindparam("run_id", type_=String)
