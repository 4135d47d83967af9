"""Each writer process's committed-row counts, kept in the database inside its own transactions.

A `WriterProcess` hands rows to a child process; if the child is killed, the rows it had not reported
are in one of two states, committed or lost, and only the database knows which. So every transaction
of the child also saves the writer's running totals (`save`, in that transaction), and the child that
replaces it starts from them (`load`): the writer's counts stay exact across any number of crashes.

Invariant: after every commit of writer `writer_id`, its row holds exactly the event rows, request
records and other producers' rows (`submit_rows`, the fleet's) that writer (all its children together)
has committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Connection, insert, select, update

from storage.schema import PROGRESS


@dataclass(frozen=True)
class Written:
    """Rows one writer has committed."""

    events: int = 0  # event rows
    requests: int = 0  # request records (those coalesced into a later record of the same request too)
    other: int = 0  # other producers' rows (`submit_rows`), as those producers count them


def load(connection: Connection, writer_id: str) -> Written:
    """What `writer_id` has committed so far (nothing, for a writer that never committed)."""
    columns = (PROGRESS.c.written_events, PROGRESS.c.written_requests, PROGRESS.c.written_other)
    row = connection.execute(select(*columns).where(PROGRESS.c.writer_id == writer_id)).one_or_none()
    return Written() if row is None else Written(row.written_events, row.written_requests, row.written_other)


def save(connection: Connection, writer_id: str, written: Written) -> None:
    """Record `written` as the totals of `writer_id`; call it in the transaction that commits them."""
    values = {
        "written_events": written.events,
        "written_requests": written.requests,
        "written_other": written.other,
        "updated_at": time.time(),
    }
    changed = connection.execute(update(PROGRESS).where(PROGRESS.c.writer_id == writer_id).values(**values))
    if not changed.rowcount:
        connection.execute(insert(PROGRESS).values(writer_id=writer_id, **values))
