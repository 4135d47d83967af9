"""Alembic environment for the history schema.

Runs only online, on the connection that `storage.migrate` puts in ``config.attributes["connection"]``
(so no alembic.ini and no URL parsing here). SQLite gets batch mode: ALTERs become table copies.
"""

from alembic import context

from storage.schema import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through storage.migrate, which supplies the connection")

context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
