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
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, func, select

from storage.db import db_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
HEAD = "head"
# Arbitrary constant naming this schema's advisory lock on PostgreSQL.
_PG_MIGRATION_LOCK = 0x70726566
_UPGRADES = threading.Lock()  # one Alembic run at a time in this process


class SchemaTooNewError(RuntimeError):
    """The database is at a schema revision these migrations do not know: a newer release wrote it. This
    code can neither read nor write it; nothing was changed. Trying again cannot help."""


def upgrade(url_or_engine: str | Engine, revision: str = HEAD) -> None:
    """Upgrade the database to `revision` (default: the newest). A no-op when already there.

    Args:
        url_or_engine: a URL or an engine from `db_engine`.
        revision: an Alembic revision id such as "0001", or "head".

    Raises:
        SchemaTooNewError: the database is at a revision newer than this code's migrations.
    """
    engine, owned = _engine(url_or_engine)
    try:
        with _UPGRADES, engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(select(func.pg_advisory_xact_lock(_PG_MIGRATION_LOCK)))
            config = _alembic_config(connection)
            _refuse_an_unknown_revision(connection, config)
            command.upgrade(config, revision)
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


def _refuse_an_unknown_revision(connection: Connection, config: Config) -> None:
    current = MigrationContext.configure(connection).get_current_revision()
    scripts = ScriptDirectory.from_config(config)
    if current is not None and current not in {script.revision for script in scripts.walk_revisions()}:
        raise SchemaTooNewError(
            f"the database's schema is at revision {current}, which this code does not know (its newest is "
            f"{scripts.get_current_head()}): a newer release wrote it, so nothing will be written to it"
        )


def _alembic_config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def _engine(url_or_engine: str | Engine) -> tuple[Engine, bool]:
    if isinstance(url_or_engine, Engine):
        return url_or_engine, False
    return db_engine(url_or_engine), True
