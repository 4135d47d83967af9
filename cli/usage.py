"""What makes a command exit with status 2: an option it cannot honour, raised as `UsageError`.

`python -m cli` (cli/__main__.py) prints such an error as `error: <message>` on stderr and exits with 2;
a command raises it instead of printing and returning. `open_database` is the one rule for a `--db` URL:
one that cannot name a database this process can use (storage.db.DatabaseUrlError: malformed, or its
driver missing) is a usage error, found before the command starts anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UsageError(ValueError):
    """An option that cannot be honoured (exit status 2)."""


def open_database(open_url: Callable[[str], T], url: str) -> T:
    """`open_url(url)` (storage.db's db_engine or existing_db_engine, a WriterProcess, ...).

    Raises:
        UsageError: `url` cannot name a usable database (storage.db.DatabaseUrlError's message).
    """
    from storage.db import DatabaseUrlError  # storage only on the --db path

    try:
        return open_url(url)
    except DatabaseUrlError as exc:
        raise UsageError(str(exc)) from None
