"""The one place that turns a database URL into a SQLAlchemy engine.

Invariants:
    * Every SQLite connection this module hands out runs with WAL journaling, a busy timeout,
      ``foreign_keys=ON``, ``synchronous=NORMAL``, a 64 MiB page cache and a 10,000-page WAL
      checkpoint interval (set by a connect event, so pooled connections and reconnects get them).
      WAL lets the console read while the writer inserts; NORMAL keeps every commit across a
      process crash (not across a power cut).
    * SQLite transactions are real transactions for DDL too (SQLAlchemy emits BEGIN itself), so a
      migration that fails part-way leaves the schema as it was.
    * PostgreSQL connections get the same lock wait as ``lock_timeout``, so a locked table surfaces as
      an error the writer can report instead of an unbounded wait.
    * Sessions are short-lived: open one per unit of work with ``open_session`` and let it close.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from sqlalchemy import URL, Connection, Engine, create_engine, event, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.orm import Session

DB_URL_ENV = "PREFIX_CONSOLE_DB_URL"
DEFAULT_BUSY_TIMEOUT_MS = 5000


# orjson: the writer encodes one detail per event, and json.dumps cost a third of its time.
_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def encode_json(value: object) -> str:
    """How JSON columns are serialised everywhere (SQLAlchemy and the writer's bulk path).

    Event details are JSON values by contract; anything else (a numpy int, a Path) is stored as its
    string form rather than failing a whole batch. Non-string keys become strings, as json.dumps does.
    """
    return orjson.dumps(value, default=str, option=_JSON_OPTIONS).decode()


def default_db_url(data_dir: Path) -> str:
    """$PREFIX_CONSOLE_DB_URL, else a SQLite file ``history.sqlite`` in `data_dir` (the caller's data
    directory: the console passes its engine configuration's)."""
    url = os.environ.get(DB_URL_ENV)
    if url:
        return url
    return f"sqlite:///{Path(data_dir) / 'history.sqlite'}"


class DatabaseUrlError(ValueError):
    """A database URL this process cannot use: malformed, of an unknown backend, or its driver is missing;
    or, for a reader, a SQLite file that does not exist."""


def db_engine(url: str, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Engine:
    """Create an engine for `url` (nothing connects yet).

    Args:
        url: any SQLAlchemy URL; SQLite files get their parent directory created.
        busy_timeout_ms: how long a statement waits for another connection's lock before failing.

    Returns:
        A new engine; callers own it and should `dispose()` it when done.

    Raises:
        DatabaseUrlError: a malformed URL, an unknown backend, or a driver that is not installed.
    """
    try:
        return _create(make_url(url), busy_timeout_ms)
    except (ArgumentError, NoSuchModuleError, ImportError) as error:
        raise _unusable(url, error) from None


def existing_db_engine(url: str) -> Engine:
    """`db_engine` for a reader: a SQLite file must exist already (connecting would create an empty one).

    Raises:
        DatabaseUrlError: as `db_engine`, or no SQLite file at the URL's path.
    """
    try:
        parsed = make_url(url)
    except ArgumentError as error:
        raise _unusable(url, error) from None
    database = parsed.database
    if parsed.get_backend_name() == "sqlite" and database and database != ":memory:" and not parsed.query.get("uri"):
        if not Path(database).is_file():
            raise DatabaseUrlError(f"no database file {database}")
    return db_engine(url)


def redacted_url(url: str) -> str:
    """`url` as a message may show it: its password hidden ("given" for a URL that does not parse, which
    may hold a password anywhere)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "given"


def _unusable(url: str, error: Exception) -> DatabaseUrlError:
    return DatabaseUrlError(f"cannot use the database URL {redacted_url(url)}: {type(error).__name__}: {error}")


def _create(parsed: URL, busy_timeout_ms: int) -> Engine:
    backend = parsed.get_backend_name()
    connect_args: dict[str, object] = {}
    if backend == "sqlite":
        _create_parent_directory(parsed.database, parsed.query)
        # The sqlite3 driver's own wait; the pragma below sets the same value on the connection.
        connect_args["timeout"] = busy_timeout_ms / 1000
    elif backend == "postgresql" and parsed.get_driver_name() in ("psycopg", "psycopg2"):
        # Replaces the URL's own `options` query value, so keep that in front.
        url_options = parsed.query.get("options", "")
        connect_args["options"] = f"{url_options} -c lock_timeout={int(busy_timeout_ms)}".strip()
    engine = create_engine(
        parsed,
        connect_args=connect_args,
        json_serializer=encode_json,
        json_deserializer=orjson.loads,  # 5-10x the standard library's json.loads on event details
        pool_pre_ping=backend != "sqlite",
    )
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas(busy_timeout_ms))
        event.listen(engine, "begin", _sqlite_begin)
    return engine


@contextmanager
def open_session(engine: Engine) -> Iterator[Session]:
    """A short-lived session: commits on success, rolls back on error, always closes."""
    with Session(engine) as session, session.begin():
        yield session


def _create_parent_directory(database: str | None, query: dict) -> None:
    if not database or database == ":memory:" or query.get("uri") or database.startswith("file:"):
        return
    parent = os.path.dirname(os.path.abspath(database))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError:
        pass  # connecting will fail with SQLite's own error, which is what callers report


def _sqlite_begin(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN")


def _sqlite_pragmas(busy_timeout_ms: int):
    def set_pragmas(dbapi_connection: sqlite3.Connection, _connection_record: object) -> None:
        # The sqlite3 module's own transaction handling never BEGINs before DDL, so a migration
        # would commit statement by statement; SQLAlchemy emits BEGIN instead (see _sqlite_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            try:
                cursor.execute("PRAGMA journal_mode = WAL")
            except sqlite3.OperationalError as error:
                # A read-only database can still be read in whatever mode it was left in.
                if error.sqlite_errorcode & 0xFF != sqlite3.SQLITE_READONLY:
                    raise
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA synchronous = NORMAL")
            # Up to 16 MiB of pages per connection (the writer's grows to it and stays): 300,000 evictions
            # into the history wrote 58,000 rows/s at 16 MiB and 54,000 at 64 MiB (the OS keeps the file
            # cached either way), and 64 MiB grew a served engine's writer by 60 MB (benchmarks/soak.py).
            cursor.execute("PRAGMA cache_size = -16384")
            # Checkpoint every ~40 MiB of WAL instead of 4 MiB: on a million-row history each batch
            # dirties pages all over the random-key indexes, and checkpointing them per batch halved
            # the writer's throughput.
            cursor.execute("PRAGMA wal_autocheckpoint = 10000")
        finally:
            cursor.close()

    return set_pragmas
