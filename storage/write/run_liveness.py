"""Runs whose owner died: told apart from live ones, and closed as interrupted when a new run starts.

Every run row names its owner, the process that started it (`host`, `pid`: `RunInfo`'s), and carries
`heartbeat_at`, the wall clock of its writer's last sign of life: set when the row is inserted and
refreshed every `HEARTBEAT_S` by the writer thread (`beat`). A run's owner that is killed with its
writer (`kill -9` of the server and its writer process) leaves the run without an end and its requests
`waiting` or `running`, forever, unless someone closes them.

The rule (`is_interrupted`): a run without an end, other than the runs of the writer asking, is
interrupted when
    * its owner ran on this host and its pid is no longer alive here, or
    * its heartbeat (for rows older than revision 0009, which have none: its start) is older than
      `STALE_AFTER_S`, wherever its owner ran.
PostgreSQL histories are shared by consoles on several hosts: a run of another host is closed only by
the heartbeat bound, never by a pid (its pid means nothing here). A pid reused by a new process keeps a
dead run open until the bound passes; a writer cut off from the database for longer than the bound may
find its run closed, and its next heartbeat reopens it (`beat`). Host names must differ between the
machines (or containers) that share one history.

Closing (`close_interrupted_runs`, in the transaction that inserts a new run): the run's `stopped_at`
becomes its last sign of life (heartbeat, else start), `end_reason` "interrupted", and its requests still
`waiting` or `running` get the status "interrupted". Idempotent: two consoles starting at once close a
dead run the same way, and a closed run is never closed again.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection

from sqlalchemy import Connection, and_, func, select, update

from storage.schema import INTERRUPTED_STATUS, OPEN_STATUSES, REQUESTS, RUNS, RunEnd

HEARTBEAT_S = 30.0  # a writer refreshes its current run's heartbeat this often, idle or not
STALE_AFTER_S = 600.0  # a run whose heartbeat is older than this is interrupted, wherever it ran


def this_host() -> str:
    """The name this host's runs carry."""
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:  # not a pid this system can have
        return False
    return True


def is_interrupted(host: str | None, pid: int | None, last_seen: float, now: float) -> bool:
    """The module's rule for a run without an end: owned by `host`/`pid`, last seen alive at `last_seen`."""
    if now - last_seen > STALE_AFTER_S:
        return True
    return host == this_host() and pid is not None and not pid_alive(pid)


def close_interrupted_runs(connection: Connection, now: float, keep: Collection[str] = ()) -> list[str]:
    """Close every run without an end, but those in `keep`, that the rule calls interrupted, with its open
    requests (see the module docstring). Returns their ids."""
    last_seen = func.coalesce(RUNS.c.heartbeat_at, RUNS.c.started_at)
    columns = (RUNS.c.id, RUNS.c.host, RUNS.c.pid, last_seen.label("last_seen"))
    statement = select(*columns).where(RUNS.c.stopped_at.is_(None))
    closed = []
    for run in connection.execute(statement):
        if run.id in keep or not is_interrupted(run.host, run.pid, run.last_seen, now):
            continue
        connection.execute(
            update(REQUESTS)
            .where(REQUESTS.c.run_id == run.id, REQUESTS.c.status.in_(OPEN_STATUSES))
            .values(status=INTERRUPTED_STATUS)
        )
        connection.execute(
            update(RUNS)
            .where(RUNS.c.id == run.id, RUNS.c.stopped_at.is_(None))
            .values(stopped_at=run.last_seen, end_reason=RunEnd.INTERRUPTED.value)
        )
        closed.append(run.id)
    return closed


def beat(connection: Connection, run_id: str, now: float) -> None:
    """Refresh `run_id`'s heartbeat; reopen it if a start elsewhere closed it as interrupted meanwhile (its
    requests closed then stay so until their next record)."""
    connection.execute(update(RUNS).where(RUNS.c.id == run_id).values(heartbeat_at=now))
    connection.execute(
        update(RUNS)
        .where(and_(RUNS.c.id == run_id, RUNS.c.end_reason == RunEnd.INTERRUPTED.value))
        .values(stopped_at=None, end_reason=None)
    )
