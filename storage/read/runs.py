"""Runs and their requests: listings, one request's event timeline, retention's log, prompt keys, where the
next run's request ids start."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
from sqlalchemy import BigInteger, cast, func, inspect, select

from storage.read.access import Readable, connect, frame
from storage.schema import EVENTS, PRUNES, REQUESTS, RUNS, RunEnd

_REQ_N = "^req-[0-9]{1,18}$"  # an id the engine generates; 18 digits always fit a BIGINT


def runs(db: Readable, limit: int = 100) -> pd.DataFrame:
    """The newest runs first, with every column of `runs`."""
    statement = select(RUNS).order_by(RUNS.c.started_at.desc()).limit(limit)
    with connect(db) as connection:
        return frame(connection, statement)


def interrupted_runs(db: Readable, limit: int = 5) -> pd.DataFrame:
    """The newest runs a later start closed as interrupted (their owner died; storage.write.run_liveness),
    newest first: id, started_at, stopped_at (the run's last sign of life)."""
    statement = (
        select(RUNS.c.id, RUNS.c.started_at, RUNS.c.stopped_at)
        .where(RUNS.c.end_reason == RunEnd.INTERRUPTED.value)
        .order_by(RUNS.c.started_at.desc(), RUNS.c.id.desc())
        .limit(limit)
    )
    with connect(db) as connection:
        return frame(connection, statement, ("id", "started_at", "stopped_at"))


def recent_requests(db: Readable, run_id: str | None = None, limit: int = 100) -> pd.DataFrame:
    """The latest requests (by arrival), of one run or of all runs, with every column of `requests`."""
    statement = select(REQUESTS).order_by(REQUESTS.c.arrival_time.desc()).limit(limit)
    if run_id is not None:
        statement = statement.where(REQUESTS.c.run_id == run_id)
    with connect(db) as connection:
        return frame(connection, statement)


def prune_log(db: Readable, limit: int = 100) -> pd.DataFrame:
    """The latest retention deletions: time, table_name, reason, rows_deleted."""
    statement = (
        select(PRUNES.c.time, PRUNES.c.table_name, PRUNES.c.reason, PRUNES.c.rows_deleted)
        .order_by(PRUNES.c.time.desc(), PRUNES.c.id.desc())
        .limit(limit)
    )
    with connect(db) as connection:
        return frame(connection, statement)



def latest_run_id(db: Readable) -> str | None:
    """The newest run's id (by start time), or None for an empty history."""
    with connect(db) as connection:
        return connection.scalar(select(RUNS.c.id).order_by(RUNS.c.started_at.desc(), RUNS.c.id.desc()).limit(1))


def has_run(db: Readable, run_id: str) -> bool:
    """Whether the history holds a run with this id."""
    with connect(db) as connection:
        return connection.scalar(select(func.count()).select_from(RUNS).where(RUNS.c.id == run_id)) > 0


def next_request_number(db: Readable) -> int:
    """One past the highest N among the request ids of the form "req-N" in every run, or 0 when there are
    none: the first number an engine writing into this history gives, so that ids stay unique across runs.

    Ids of other forms ("a", "req-x", "req-" with more than 18 digits) are ignored; a database whose
    schema is not created yet reads as an empty history.
    """
    with connect(db) as connection:
        if not inspect(connection).has_table(REQUESTS.name):
            return 0
        number = cast(func.substr(REQUESTS.c.request_id, len("req-") + 1), BigInteger)
        highest = connection.scalar(select(func.max(number)).where(REQUESTS.c.request_id.regexp_match(_REQ_N)))
    return 0 if highest is None else highest + 1


def request_timeline(db: Readable, request_id: str, run_id: str | None = None) -> pd.DataFrame:
    """Every event of one request, in order (time, then insertion).

    Args:
        request_id: the request.
        run_id: its run; None searches every run (request ids may repeat across runs).
    """
    columns = ("id", "run_id", "step", "time", "kind", "block_id", "tokens", "detail")
    conditions = [EVENTS.c.request_id == request_id]
    if run_id is not None:
        conditions.append(EVENTS.c.run_id == run_id)
    statement = select(*(EVENTS.c[name] for name in columns)).where(*conditions).order_by(EVENTS.c.time, EVENTS.c.id)
    with connect(db) as connection:
        return frame(connection, statement, columns)



def prompt_chains(db: Readable, run_ids: Sequence[str] = (), limit: int = 1_000_000) -> pd.DataFrame:
    """The finished requests whose prompt keys are stored (revision 0004), oldest arrival first, for the
    workload analyzer: one row per request with `run_id`, `request_id`, `arrival_time`, `prompt_tokens`,
    `output_tokens`, `block_keys`, `content_keys` (bytes, 16 per full block) and its run's `block_size`,
    `model`, `weights_revision` and `dtype`.

    Args:
        db: the history.
        run_ids: the runs to read; empty reads every run.
        limit: at most this many requests (the oldest).
    """
    statement = (
        select(
            REQUESTS.c.run_id,
            REQUESTS.c.request_id,
            REQUESTS.c.arrival_time,
            REQUESTS.c.prompt_tokens,
            func.json_array_length(REQUESTS.c.output_token_ids).label("output_tokens"),
            REQUESTS.c.block_keys,
            REQUESTS.c.content_keys,
            RUNS.c.block_size,
            RUNS.c.model,
            RUNS.c.weights_revision,
            RUNS.c.dtype,
        )
        .join(RUNS, RUNS.c.id == REQUESTS.c.run_id)
        .where(REQUESTS.c.block_keys.is_not(None))
        .order_by(REQUESTS.c.arrival_time, REQUESTS.c.run_id, REQUESTS.c.request_id)
        .limit(limit)
    )
    if run_ids:
        statement = statement.where(REQUESTS.c.run_id.in_(list(run_ids)))
    with connect(db) as connection:
        return frame(connection, statement)
