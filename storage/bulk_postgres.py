"""PostgreSQL bulk writes: COPY for inserts (psycopg), INSERT ... ON CONFLICT for upserts (any driver)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import Insert
from sqlalchemy.exc import DBAPIError

from storage.models import REQUEST_KEY, REQUESTS


def copy_rows(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """COPY FROM STDIN in the current transaction, through psycopg (about twice the rows/s of
    executemany). The statement is composed by psycopg from quoted identifiers.

    Raises:
        sqlalchemy.exc.DBAPIError: the driver's error, wrapped as SQLAlchemy wraps every statement's, so
            the writer classifies it like any other failure.
    """
    from psycopg import sql  # the PostgreSQL driver; SQLite users need not install it

    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table.name), sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    driver_connection = connection.connection.driver_connection
    try:
        with driver_connection.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)
    except connection.dialect.loaded_dbapi.Error as error:
        text = statement.as_string(driver_connection)
        raise DBAPIError.instance(text, None, error, connection.dialect.loaded_dbapi.Error) from error


def upsert_rows(connection: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert or replace `requests` rows (distinct keys, the same columns) by (run_id, request_id)."""
    connection.execute(_upsert_statement(tuple(rows[0])), rows)


@functools.cache
def _upsert_statement(columns: tuple[str, ...]) -> Insert:
    """Built once per column set: building it costs more than a batch of request rows."""
    statement = postgresql.insert(REQUESTS)
    updates = {name: statement.excluded[name] for name in columns if name not in REQUEST_KEY}
    return statement.on_conflict_do_update(index_elements=REQUEST_KEY, set_=updates)
