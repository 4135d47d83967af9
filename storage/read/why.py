"""What the miss diagnosis (analysis/why.py) reads: requests with their prompts and runs, and evictions (the
disk tier's moves it reads from storage/read/tier_history.py).

A request's prompt token ids and tenant salt come from its SUBMIT event's detail (engine/core/events.py);
its output token ids, parent, counts, times and prompt keys from `requests`; its namespace, block size, model and dtype from its
run. A request whose SUBMIT event is gone (retention) or predates prompts in the detail has
`prompt_token_ids` None.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import Engine, and_, select

from storage.schema import EVENTS, EVICTIONS, REQUESTS, RUNS

MAX_EARLIER = 20_000  # earlier requests a diagnosis compares against (the newest ones)
SUBMIT = "submit"  # EventKind.SUBMIT's value


class WhyRequest(NamedTuple):
    """One request as the diagnosis reads it (analysis/why.py's HistoryRequest)."""

    run_id: str
    request_id: str
    status: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    prompt_token_ids: tuple[int, ...] | None
    output_token_ids: tuple[int, ...]
    parent_id: str | None
    salt: str | None
    cached_tokens: int
    prompt_tokens: int
    hit_source: str
    block_keys: bytes | None
    replay_mode: str | None
    r: int | None
    namespace: str | None
    block_size: int
    model: str
    dtype: str
    weights_revision: str | None
    disk_cached_tokens: int = 0  # of cached_tokens, those promoted from the disk tier


class WhyEviction(NamedTuple):
    """One eviction (analysis/why.py's EvictionFact)."""

    at: float
    reason: str
    block: int | None
    key_hex: str
    group: str | None


_COLUMNS = (
    REQUESTS.c.run_id, REQUESTS.c.request_id, REQUESTS.c.status, REQUESTS.c.arrival_time,
    REQUESTS.c.first_scheduled_time, REQUESTS.c.first_token_time, EVENTS.c.detail, REQUESTS.c.output_token_ids,
    REQUESTS.c.parent_id, REQUESTS.c.cached_tokens,
    REQUESTS.c.prompt_tokens, REQUESTS.c.hit_source, REQUESTS.c.block_keys, REQUESTS.c.replay_mode, REQUESTS.c.r,
    RUNS.c.namespace, RUNS.c.block_size, RUNS.c.model, RUNS.c.dtype, RUNS.c.weights_revision,
    REQUESTS.c.disk_cached_tokens,
)  # fmt: skip


def _statement():
    submit = and_(EVENTS.c.run_id == REQUESTS.c.run_id, EVENTS.c.request_id == REQUESTS.c.request_id,
                  EVENTS.c.kind == SUBMIT)  # fmt: skip
    return (
        select(*_COLUMNS)
        .select_from(REQUESTS.join(RUNS, RUNS.c.id == REQUESTS.c.run_id).outerjoin(EVENTS, submit))
    )


def _request(row: Any) -> WhyRequest:
    (run_id, request_id, status, arrival, scheduled, first_token, detail, output, parent_id, cached, prompt_tokens,
     hit_source, keys, replay_mode, r, namespace, block_size, model, dtype, revision, disk_cached) = row  # fmt: skip
    detail = detail or {}
    prompt = detail.get("prompt_token_ids")
    return WhyRequest(run_id, request_id, status, arrival, scheduled, first_token,
                      None if prompt is None else tuple(prompt), tuple(output or ()), parent_id, detail.get("salt"),
                      cached, prompt_tokens, hit_source, keys, replay_mode, r, namespace, block_size, model, dtype,
                      revision, disk_cached or 0)  # fmt: skip


def find_request(db: Engine, request_id: str, run_id: str | None = None) -> WhyRequest | None:
    """A request by id: in `run_id`, or in the newest run that has it; None when there is none."""
    statement = _statement().where(REQUESTS.c.request_id == request_id)
    if run_id is not None:
        statement = statement.where(REQUESTS.c.run_id == run_id)
    statement = statement.order_by(RUNS.c.started_at.desc()).limit(1)
    with db.connect() as connection:
        row = connection.execute(statement).first()
    return None if row is None else _request(row)


def requests_before(db: Engine, before: float, limit: int = MAX_EARLIER) -> list[WhyRequest]:
    """The newest `limit` requests of every run that arrived before `before`, oldest first."""
    statement = _statement().where(REQUESTS.c.arrival_time < before)
    statement = statement.order_by(REQUESTS.c.arrival_time.desc()).limit(limit)
    with db.connect() as connection:
        rows = connection.execute(statement).all()
    return [_request(row) for row in reversed(rows)]


def run_requests(db: Engine, run_id: str) -> list[WhyRequest]:
    """Every request of one run, oldest first."""
    statement = _statement().where(REQUESTS.c.run_id == run_id).order_by(REQUESTS.c.arrival_time)
    with db.connect() as connection:
        return [_request(row) for row in connection.execute(statement).all()]


def latest_eviction(db: Engine, run_id: str, key_hex: str, before: float) -> WhyEviction | None:
    """The latest eviction of the chain key `key_hex` in a run before a time, or None."""
    statement = (
        select(EVICTIONS.c.time, EVICTIONS.c.reason, EVICTIONS.c.block_id, EVICTIONS.c.key_hex, EVICTIONS.c.group)
        .where(EVICTIONS.c.run_id == run_id, EVICTIONS.c.key_hex == key_hex.lower(), EVICTIONS.c.time <= before)
        .order_by(EVICTIONS.c.time.desc(), EVICTIONS.c.id.desc())
        .limit(1)
    )
    with db.connect() as connection:
        row = connection.execute(statement).first()
    return None if row is None else WhyEviction(*row)
