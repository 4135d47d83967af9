"""Bring a database to a schema revision with Alembic, configured entirely in code.

The migration scripts live in ``storage/migrations`` next to this module; nothing depends on the
working directory or on an alembic.ini. Each upgrade runs on one connection in one transaction
(PostgreSQL: atomic, and serialised across processes by an advisory lock). Within a process upgrades
take turns (`_UPGRADES`): Alembic's `context` is process-global, and two threads migrating at once (two
writers starting together) corrupted each other's run.
"""

from __future__ import annotations

import threading
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, func, select

from storage.db import db_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
HEAD = "head"
# Arbitrary constant naming this schema's advisory lock on PostgreSQL.
_PG_MIGRATION_LOCK = 0x70726566
_UPGRADES = threading.Lock()  # one Alembic run at a time in this process


def upgrade(url_or_engine: str | Engine, revision: str = HEAD) -> None:
    """Upgrade the database to `revision` (default: the newest). A no-op when already there.

    Args:
        url_or_engine: a URL or an engine from `db_engine`.
        revision: an Alembic revision id such as "0001", or "head".
    """
    engine, owned = _engine(url_or_engine)
    try:
        with _UPGRADES, engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(select(func.pg_advisory_xact_lock(_PG_MIGRATION_LOCK)))
            command.upgrade(_alembic_config(connection), revision)
    finally:
        if owned:
            engine.dispose()


def current_revision(url_or_engine: str | Engine) -> str | None:
    """The revision the database is at, or None for a database Alembic never touched."""
    engine, owned = _engine(url_or_engine)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        if owned:
            engine.dispose()


def _alembic_config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def _engine(url_or_engine: str | Engine) -> tuple[Engine, bool]:
    if isinstance(url_or_engine, Engine):
        return url_or_engine, False
    return db_engine(url_or_engine), True
