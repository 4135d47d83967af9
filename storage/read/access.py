"""How the read modules reach the database: any handle the console holds, and rows into DataFrames.

`Readable` is an Engine, Connection or Session; `connect(db)` yields a Connection on it (a new one for an
Engine, closed afterwards; the session's own for a Session); `frame` runs a statement into a DataFrame.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pandas as pd
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

Readable = Engine | Connection | Session


@contextmanager
def connect(db: Readable) -> Iterator[Connection]:
    """A connection on `db` for the duration of the block."""
    if isinstance(db, Engine):
        with db.connect() as connection:
            yield connection
    elif isinstance(db, Session):
        yield db.connection()
    else:
        yield db



def frame(connection: Connection, statement, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """The statement's rows as a DataFrame (`columns`, else the result's own)."""
    result = connection.execute(statement)
    # Plain tuples: pandas 3 mis-infers column dtypes from SQLAlchemy Row objects.
    return pd.DataFrame([tuple(row) for row in result.all()], columns=list(columns or result.keys()))

