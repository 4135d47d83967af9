"""PostgreSQL bulk writes: COPY for inserts (psycopg), INSERT ... ON CONFLICT for upserts (any driver)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import JSON, Connection, Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import Insert
from sqlalchemy.exc import DBAPIError

from storage.schema import REQUEST_KEY, REQUESTS


def copy_rows(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """COPY FROM STDIN in binary format in the current transaction, through psycopg (about twice the
    rows/s of executemany; binary, a third of text COPY's client time: numbers travel as machine values,
    not digits). Each value is dumped as its column's type (`_copy_types`); a JSON column's value is its
    JSON text, as in every bulk path, and the server parses and checks it. The statement is composed by
    psycopg from quoted identifiers.

    Raises:
        sqlalchemy.exc.DBAPIError: the driver's error, wrapped as SQLAlchemy wraps every statement's, so
            the writer classifies it like any other failure.
    """
    from psycopg import sql  # the PostgreSQL driver; SQLite users need not install it

    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
        sql.Identifier(table.name), sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    types = _copy_types(table, tuple(columns))
    driver_connection = connection.connection.driver_connection
    try:
        with driver_connection.cursor() as cursor, cursor.copy(statement) as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row(row)
    except connection.dialect.loaded_dbapi.Error as error:
        text = statement.as_string(driver_connection)
        raise DBAPIError.instance(text, None, error, connection.dialect.loaded_dbapi.Error) from error


@functools.cache
def _copy_types(table: Table, columns: tuple[str, ...]) -> list[str]:
    """The PostgreSQL type each column's values are dumped as in a binary COPY: the column's own type,
    but "text" for a JSON column (the binary form of PostgreSQL's json is its text; jsonb's is not, and
    no table has one)."""
    dialect = postgresql.psycopg.dialect()
    return ["text" if isinstance(table.c[name].type, JSON) else table.c[name].type.compile(dialect=dialect).lower()
            for name in columns]  # fmt: skip


def upsert_rows(connection: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert or replace `requests` rows (distinct keys, the same columns) by (run_id, request_id)."""
    connection.execute(_upsert_statement(tuple(rows[0])), rows)


@functools.cache
def _upsert_statement(columns: tuple[str, ...]) -> Insert:
    """Built once per column set: building it costs more than a batch of request rows."""
    statement = postgresql.insert(REQUESTS)
    updates = {name: statement.excluded[name] for name in columns if name not in REQUEST_KEY}
    return statement.on_conflict_do_update(index_elements=REQUEST_KEY, set_=updates)
