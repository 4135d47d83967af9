"""The history store on real databases: SQLite files and a throwaway PostgreSQL server.

Every test that takes `db_url` runs once per backend; the fixtures (databases, writers, a known history)
and the event and request-view builders are in tests/storage_support.py.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import JSON, Column, Engine, Index, MetaData, String, Table, func, insert, inspect, select
from sqlalchemy import column as sql_column
from sqlalchemy import table as sql_table
from sqlalchemy.exc import DBAPIError

from engine.core.events import Event, EventKind
from engine.core.request import HitSource, Request, RequestStatus, SamplingParams
from storage import migrate
from storage.read import queries
from storage.db import DB_URL_ENV, db_engine, default_db_url, open_session
from storage.schema import (
    AGE_EDGES_S,
    EVENT_COLUMNS,
    EVENTS,
    HIT_EDGES,
    REQUESTS,
    ROLLUPS,
    Base,
    Prune,
)
from storage.read.queries import Cursor, EvictionFilters
from storage.write.retention import RetentionPolicy, prune
from storage.write import progress
from storage.write.rows import event_values, request_row
from storage.write.writer import RunInfo, WriterOptions
from storage.write.writer_process import WriterProcess
from tests.storage_support import (
    BASE_TIME,
    FAST,
    LATEST_REVISION,
    REASONS,
    REPO,
    RUN_INFO,
    cache,
    count_rows,
    evict,
    request_view,
    wait_for,
)


# ---------------------------------------------------------------- the database handle


def test_sqlite_connections_get_wal_busy_timeout_foreign_keys_and_normal_sync(tmp_path: Path) -> None:
    engine = db_engine(f"sqlite:///{tmp_path / 'nested' / 'dir' / 'h.sqlite'}", busy_timeout_ms=1234)
    with engine.connect() as connection:
        pragma = lambda name: connection.exec_driver_sql(f"PRAGMA {name}").scalar()  # noqa: E731
        assert pragma("journal_mode") == "wal"
        assert pragma("busy_timeout") == 1234
        assert pragma("foreign_keys") == 1
        assert pragma("synchronous") == 1  # NORMAL
    engine.dispose()


def test_default_url_comes_from_the_environment_else_the_callers_data_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(DB_URL_ENV, raising=False)
    assert default_db_url(tmp_path) == f"sqlite:///{tmp_path / 'history.sqlite'}"
    monkeypatch.setenv(DB_URL_ENV, "postgresql+psycopg://someone@db/history")
    assert default_db_url(tmp_path) == "postgresql+psycopg://someone@db/history"


# ---------------------------------------------------------------- migrations


def test_the_schema_at_head_matches_the_models(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine)
    with engine.connect() as connection:
        assert migrate.current_revision(engine) == LATEST_REVISION
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    migrate.upgrade(engine)  # a second upgrade is a no-op


def test_a_database_made_by_the_first_schema_upgrades_without_losing_rows(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine, "0001")
    runs = sql_table(
        "runs", *map(sql_column, ("id", "model", "num_blocks", "block_size", "dtype", "device", "started_at"))
    )
    request_columns = (
        "run_id",
        "request_id",
        "status",
        "prompt_tokens",
        "cached_tokens",
        "computed_tokens",
        "hit_source",
    )
    requests = sql_table(
        "requests",
        *map(sql_column, request_columns + ("cow_copies", "preemptions", "arrival_time")),
        sql_column("output_token_ids", JSON),
    )
    events = sql_table(
        "events", *map(sql_column, ("run_id", "step", "time", "kind", "tokens")), sql_column("detail", JSON)
    )
    evictions = sql_table("evictions", *map(sql_column, ("run_id", "time", "reason", "age_s", "hit_count", "key_hex")))
    run_row = {"id": "old", "model": "m", "num_blocks": 4, "block_size": 16, "dtype": "float32", "device": "cpu"}
    request_rows = [
        {
            "run_id": "old",
            "request_id": f"r{i}",
            "status": "finished",
            "prompt_tokens": 10,
            "cached_tokens": i,
            "computed_tokens": 10 - i,
            "hit_source": "prefix",
            "cow_copies": 0,
            "preemptions": 0,
            "arrival_time": BASE_TIME + i,
            "output_token_ids": [i],
        }
        for i in range(2)
    ]
    event_rows = [
        {"run_id": "old", "step": i, "time": BASE_TIME + i, "kind": "cache", "tokens": 16, "detail": {"i": i}}
        for i in range(3)
    ]
    eviction_rows = [
        {
            "run_id": "old",
            "time": BASE_TIME + 50 * i,
            "reason": "lru",
            "age_s": 10.0**i,
            "hit_count": i,
            "key_hex": "ab",
        }
        for i in range(4)
    ]
    with engine.begin() as connection:
        connection.execute(insert(runs), [{**run_row, "started_at": BASE_TIME}])
        connection.execute(insert(requests), request_rows)
        connection.execute(insert(events), event_rows)
        connection.execute(insert(evictions), eviction_rows)

    migrate.upgrade(engine)

    assert migrate.current_revision(engine) == LATEST_REVISION
    assert count_rows(engine, EVENTS) == 3
    assert queries.request_timeline(engine, "missing").empty
    recorded = queries.recent_requests(engine, "old").sort_values("request_id")
    assert recorded["cached_tokens"].tolist() == [0, 1]
    assert recorded["output_token_ids"].tolist() == [[0], [1]]
    assert recorded[["h", "s", "e", "r", "replay_mode", "replayed_tokens"]].isna().all().all()
    # The rollups were backfilled from the old eviction rows.
    assert queries.eviction_count(engine) == queries.eviction_count(engine, use_rollups=False) == 4
    rolled = queries.age_at_eviction_histogram(engine)["evictions"].tolist()
    assert rolled == queries.age_at_eviction_histogram(engine, use_rollups=False)["evictions"].tolist()
    assert rolled == [0, 1, 1, 1, 0, 1, 0, 0, 0]  # ages 1, 10, 100, 1000


def test_a_migration_that_fails_part_way_leaves_the_schema_as_it_was(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine, "0002")
    # An index that takes the name 0003 creates last, so 0003 fails after creating its table.
    # On a stand-in of the prunes table: an Index built on PRUNES's own column would join the models'
    # metadata for the rest of the session (and every later schema comparison would expect it).
    prunes = Table("prunes", MetaData(), Column("reason", String))
    with engine.begin() as connection:
        Index("ix_eviction_rollups_minute", prunes.c.reason).create(connection)
    with pytest.raises(DBAPIError):
        migrate.upgrade(engine)
    assert migrate.current_revision(engine) == "0002"
    with engine.connect() as connection:
        assert "eviction_rollups" not in inspect(connection).get_table_names()


def test_revision_0008_keeps_the_writer_progress_of_a_database_at_0007(db_url: str, engine_for) -> None:
    """A writer's totals saved before the fleet's rows were counted stay as they were, the fleet's at 0;
    from then on the fleet's rows are saved and read back with the rest."""
    engine = engine_for(db_url)
    migrate.upgrade(engine, "0007")
    progress_at_0007 = sql_table(
        "writer_progress", *map(sql_column, ("writer_id", "written_events", "written_requests", "updated_at"))
    )
    with engine.begin() as connection:
        old = {"writer_id": "old", "written_events": 120, "written_requests": 7, "updated_at": BASE_TIME}
        connection.execute(insert(progress_at_0007), [old])

    migrate.upgrade(engine)

    assert migrate.current_revision(engine) == LATEST_REVISION
    with engine.begin() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        assert progress.load(connection, "old") == progress.Written(events=120, requests=7, other=0)
        progress.save(connection, "old", progress.Written(events=121, requests=7, other=5))
    with engine.connect() as connection:
        assert progress.load(connection, "old") == progress.Written(events=121, requests=7, other=5)


# ---------------------------------------------------------------- the writer


def test_history_survives_a_restart(db_url: str, make_writer, engine_for) -> None:
    first = make_writer(db_url)
    first_run = first.start_run(RUN_INFO)
    first.submit([evict(i, BASE_TIME + i) for i in range(10)] + [cache(i, BASE_TIME + i) for i in range(5)])
    first.record_requests([request_view("a", output_token_ids=[7])])
    first.record_requests([request_view("a", output_token_ids=[7, 8], cached_tokens=2)])  # last write wins
    assert first.close()

    second = make_writer(db_url)
    second_run = second.start_run(RunInfo(**{**vars(RUN_INFO), "started_at": BASE_TIME + 100}))
    second.submit([evict(100 + i, BASE_TIME + 100 + i) for i in range(3)])
    assert second.flush(timeout_s=10)

    engine = engine_for(db_url)
    runs = queries.runs(engine)
    assert runs["id"].tolist() == [second_run, first_run]  # newest first
    assert runs["stopped_at"].isna().tolist() == [True, False]  # the second is still running
    assert queries.eviction_count(engine) == 13
    assert queries.eviction_count(engine, EvictionFilters(run_id=first_run)) == 10
    assert count_rows(engine, EVENTS) == 18
    request = queries.recent_requests(engine, first_run).iloc[0]
    assert request["output_token_ids"] == [7, 8] and request["cached_tokens"] == 2 and request["prompt_tokens"] == 3
    assert first.stats().written_events == 15 and first.stats().dropped == 0


def test_the_next_run_numbers_its_requests_past_the_highest_req_n_of_every_run(
    db_url: str, make_writer, engine_for
) -> None:
    engine = engine_for(db_url)
    assert queries.next_request_number(engine) == 0  # no schema yet
    migrate.upgrade(engine)
    assert queries.next_request_number(engine) == 0  # no requests yet: a fresh engine starts at req-0

    writer = make_writer(db_url)
    writer.start_run(RUN_INFO)
    ignored = ("a", "req-x", "req-", "xreq-50", "req-40b", "req-5-1", "req-" + "9" * 19)  # not of the form req-N
    writer.record_requests([request_view(rid) for rid in ("req-3", "req-12", *ignored)])
    writer.start_run(RunInfo(**{**vars(RUN_INFO), "started_at": BASE_TIME + 100}))
    writer.record_requests([request_view("req-9")])  # lower than the first run's highest
    assert writer.flush(timeout_s=10)
    assert count_rows(engine, REQUESTS) == 2 + len(ignored) + 1
    assert queries.next_request_number(engine) == 13


def test_request_views_are_stored_with_their_window_fields(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    run_id = writer.start_run(RUN_INFO)
    writer.record_requests(
        [
            request_view(
                "prefix-hit",
                prompt_token_ids=[1, 2, 3, 4],
                output_token_ids=[9],
                cached_tokens=2,
                replay_from=2,
                computed_tokens=2,
                hit_source="prefix",
                first_scheduled_time=BASE_TIME + 1,
            ),
            request_view("window", cached_tokens=5, window_start=1, window_end=6, replay_from=2, replay_mode="full",
                         replayed_tokens=4),
        ]
    )  # fmt: skip
    assert writer.flush(timeout_s=10)
    engine = engine_for(db_url)
    rows = queries.recent_requests(engine, run_id).set_index("request_id")
    assert rows.loc["prefix-hit", "status"] == "finished" and rows.loc["prefix-hit", "hit_source"] == "prefix"
    assert rows.loc["prefix-hit", "prompt_tokens"] == 4
    assert rows.loc["window", "h"] == 5 and rows.loc["window", "replay_mode"] == "full"
    assert (rows.loc["window", "s"], rows.loc["window", "e"], rows.loc["window", "r"]) == (1, 6, 2)
    assert queries.hit_rate_over_time(engine, 60)["hit_rate"].tolist() == [0.5]


def test_the_writers_refuse_anything_but_engine_events_and_views_at_the_call(tmp_path: Path, make_writer) -> None:
    """Regression: dicts and engine Requests were accepted and converted by the writer thread, whose
    conversion then failed the whole batch (or stored the wrong prompt length) far from the caller."""
    writer = make_writer(f"sqlite:///{tmp_path / 'h.sqlite'}")
    writer.start_run(RUN_INFO)
    engine_request = Request(
        request_id="obj", prompt_token_ids=[1, 2, 3, 4], sampling=SamplingParams(), status=RequestStatus.FINISHED,
        hit_source=HitSource.PREFIX, arrival_time=BASE_TIME,
    )  # fmt: skip
    with pytest.raises(TypeError, match="RequestView"):
        writer.record_requests([engine_request])
    with pytest.raises(TypeError, match="RequestView.*dict"):
        writer.record_requests([request_view("ok"), {"request_id": "x", "status": "finished", "arrival_time": 1.0}])
    with pytest.raises(ValueError, match="status"):
        writer.record_requests([request_view("x", status=None)])
    with pytest.raises(TypeError, match="Event.*dict"):
        writer.submit([cache(0, BASE_TIME), {"kind": "cache", "step": 1}])
    with pytest.raises(TypeError, match="Event.*tuple"):
        writer.submit([tuple(cache(0, BASE_TIME))])
    assert writer.flush(timeout_s=10)
    stats = writer.stats()
    assert (stats.written_events, stats.written_requests, stats.dropped, stats.queued) == (0, 0, 0, 0)


def test_a_batch_waits_for_more_rows_but_flush_cuts_the_wait_short(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url, batch_interval_s=30.0)
    writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME + i) for i in range(5)])
    assert wait_for(lambda: writer.stats().schema_ready)
    assert count_rows(engine_for(db_url), EVENTS) == 0  # still gathering its batch (for 30 s)
    assert writer.stats().queued == 5 and writer.stats().lag_s > 0
    assert writer.flush(timeout_s=10)  # well before the 30 s are up
    assert count_rows(engine_for(db_url), EVENTS) == 5
    assert writer.stats().lag_s == 0.0


def test_a_mark_is_reached_once_every_row_before_it_is_written(db_url: str, make_writer, engine_for) -> None:
    """Read-your-writes: the console takes a mark after an action and waits for it before it reads."""
    writer = make_writer(db_url, batch_interval_s=30.0)
    run_id = writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME + i) for i in range(5)])
    writer.record_requests([request_view("a", status="running")])
    writer.record_requests([request_view("a")])
    mark = writer.mark()
    assert writer.stats().done_mark < mark
    assert wait_for(lambda: writer.stats().lag_s >= 0.05)  # the oldest row is getting older
    assert writer.wait(mark, timeout_s=20)  # long before the batch interval ends
    stats = writer.stats()
    assert stats.done_mark >= mark and stats.queued == 0 and stats.lag_s == 0.0
    assert (stats.written_events, stats.written_requests) == (5, 2)
    engine = engine_for(db_url)
    assert queries.eviction_count(engine, use_rollups=False) == 5
    assert queries.recent_requests(engine, run_id)["status"].tolist() == ["finished"]
    assert writer.wait(writer.mark(), timeout_s=0)  # nothing new: reached at once
    writer.submit([cache(9, BASE_TIME)])
    assert writer.mark() > mark and writer.wait(mark, timeout_s=0)  # a later row does not hold an earlier mark


def test_request_views_are_coalesced_per_batch(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url, batch_interval_s=30.0)  # everything below lands in one batch
    run_id = writer.start_run(RUN_INFO)
    writer.record_requests([request_view("a", output_token_ids=[1])])
    for step in range(2, 6):  # the engine publishes a running request on every step
        writer.record_requests([request_view("a", status="running", output_token_ids=list(range(1, step)))])
    writer.record_requests([request_view("b")])
    assert writer.flush(timeout_s=10)
    rows = queries.recent_requests(engine_for(db_url), run_id).set_index("request_id")
    assert rows.loc["a", "output_token_ids"] == [1, 2, 3, 4] and rows.loc["a", "status"] == "running"
    assert sorted(rows.index) == ["a", "b"]
    stats = writer.stats()
    assert stats.written_requests == 6 and stats.written_batches == 1 and stats.dropped == 0


def test_sqlite_json_paths_store_exactly_what_the_row_functions_build(tmp_path: Path, make_writer, engine_for) -> None:
    """On SQLite, events and engine views go in through one JSON statement per batch; every stored value
    must equal what storage.write.rows builds for the generic path (PostgreSQL runs that path)."""
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    writer = make_writer(url)
    run_id = writer.start_run(RUN_INFO)
    events = [
        evict(1, BASE_TIME + 0.125, age_s=1e-05, key="ABCDEF0123456789"),
        cache(2, BASE_TIME + 1),
        Event(EventKind.RESET, 3, BASE_TIME + 2, None, None, 0, {"dropped_blocks": 4, "ok": False, "kept_blocks": 1}),
        Event(EventKind.RELEASE, 4, BASE_TIME + 3, "req-9", 7, 24, {"block_ids": [7, 3], "freed": 2, "group": "full"}),
        Event(EventKind.REPLAY, 5, BASE_TIME + 4, "req-9", None, 5, {"kl": 0.25, "top1": 1.0, "mode": "exact"}),
    ]
    view = request_view(
        "req-9", parent_id="req-1", prompt_token_ids=(1, 2, 3), output_token_ids=(4, 5), num_computed_tokens=5,
        cached_tokens=2, computed_tokens=1, hit_source="fork", cow_copies=1, preemptions=2,
        finish_reason="length", first_scheduled_time=BASE_TIME + 0.5, first_token_time=BASE_TIME + 0.75,
        block_tables={"full": (7, 3)}, max_new_tokens=2, window_start=1, window_end=3, replay_from=2,
        replay_mode="exact", replayed_tokens=1,
    )  # fmt: skip
    writer.submit(events)
    writer.record_requests([view._replace(status="running", output_token_ids=(4,)), view])
    assert writer.flush(timeout_s=10)

    engine = engine_for(url)
    with engine.connect() as connection:
        stored = connection.execute(
            select(*(EVENTS.c[name] for name in EVENT_COLUMNS)).order_by(EVENTS.c.id)
        ).all()
        request = connection.execute(select(REQUESTS)).mappings().one()
    expected = [event_values(run_id, event) for event in events]
    assert [row[:-1] for row in stored] == [row[:-1] for row in expected]
    assert [row[-1] for row in stored] == [json.loads(row[-1]) for row in expected]  # the JSON column, decoded
    assert dict(request) == request_row(run_id, view)


def test_rows_before_a_run_are_a_programming_error(tmp_path: Path, make_writer) -> None:
    writer = make_writer(f"sqlite:///{tmp_path / 'h.sqlite'}")
    with pytest.raises(RuntimeError, match="start_run"):
        writer.submit([cache(0, BASE_TIME)])


def test_readers_see_monotonic_counts_while_the_writer_inserts(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    writer.start_run(RUN_INFO)
    assert writer.flush(timeout_s=10)
    engine = engine_for(db_url)
    seen: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read_repeatedly() -> None:
        try:
            while not done.is_set():
                log_rows = queries.eviction_count(engine, use_rollups=False)
                rolled = queries.eviction_count(engine)
                seen.append((log_rows, rolled))
                queries.eviction_log(engine, page_size=20)
        except BaseException as error:  # reported to the test thread below
            errors.append(error)

    reader = threading.Thread(target=read_repeatedly)
    reader.start()
    total = 0
    for step in range(100):
        t = BASE_TIME + step
        writer.submit([evict(step * 40 + i, t) for i in range(20)] + [cache(step * 40 + i, t) for i in range(20)])
        total += 20
        if step % 25 == 24:  # let the reader read while rows keep coming
            reads = len(seen)
            assert wait_for(lambda: len(seen) > reads or errors)
    assert writer.flush(timeout_s=30)
    done.set()
    reader.join(timeout=30)

    assert errors == []
    assert len(seen) > 3
    log_counts = [log_rows for log_rows, _ in seen]
    assert log_counts == sorted(log_counts) and log_counts[-1] <= total
    assert [rolled for _, rolled in seen] == sorted(rolled for _, rolled in seen)
    assert queries.eviction_count(engine) == queries.eviction_count(engine, use_rollups=False) == total
    assert writer.stats().written_events == 2 * total


def test_a_writer_process_sends_pending_request_records_once_the_engine_is_quiet(tmp_path: Path) -> None:
    """Request records wait to be coalesced; with no flush and nothing else coming they still go out."""
    writer = WriterProcess(f"sqlite:///{tmp_path / 'history.sqlite'}", WriterOptions(**FAST, batch_interval_s=0.2))
    writer.start_run(RUN_INFO)
    writer.record_requests([request_view("a", status="running")])  # the first goes out at once
    writer.record_requests([request_view("a", status="running", output_token_ids=[4])])
    writer.record_requests([request_view("a", output_token_ids=[4, 5])])  # supersedes the one before
    assert wait_for(lambda: writer.stats().written_requests == 3, timeout_s=20)  # the superseded one counts
    assert writer.stats().queued == 0
    writer.close(timeout_s=20)


def test_retention_runs_in_the_background_and_is_logged(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(
        db_url, prune_interval_s=0.05, retention=RetentionPolicy(max_age_days=None, max_events=150, max_evictions=40)
    )
    writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME + i) for i in range(100)] + [cache(i, BASE_TIME + i) for i in range(100)])
    assert writer.flush(timeout_s=10)
    engine = engine_for(db_url)
    assert wait_for(lambda: queries.eviction_count(engine, use_rollups=False) == 40)
    assert wait_for(lambda: count_rows(engine, EVENTS) == 150)
    assert wait_for(lambda: writer.stats().pruned_rows == 110)
    newest = queries.eviction_log(engine, page_size=100).rows
    assert newest["time"].min() == BASE_TIME + 60  # the oldest went first
    assert queries.eviction_count(engine) == 40  # rollups follow the log
    log = queries.prune_log(engine)
    assert sorted(zip(log["table_name"], log["reason"], log["rows_deleted"], strict=True)) == [
        ("events", "max_rows", 50),
        ("evictions", "max_rows", 60),
    ]


def test_pruning_by_age_keeps_rollups_equal_to_the_log(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME + 7.5 * i, age_s=float(i), hit_count=i) for i in range(80)])
    writer.record_requests(
        [request_view("old", arrival_time=BASE_TIME), request_view("new", arrival_time=BASE_TIME + 500)]
    )
    assert writer.close()
    engine = engine_for(db_url)
    cutoff = BASE_TIME + 7.5 * 30 + 1  # mid-minute
    day = 86_400.0
    results = prune(engine, RetentionPolicy(max_age_days=1.0, max_events=None, max_evictions=None), now=cutoff + day)
    assert {(r.table_name, r.rows_deleted) for r in results} == {("events", 31), ("evictions", 31), ("requests", 1)}
    assert queries.eviction_count(engine, use_rollups=False) == 49
    assert_rollups_match_the_log(engine, EvictionFilters())
    with engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(Prune)) == 3


# ---------------------------------------------------------------- queries


def matching(rows: list[dict], filters: EvictionFilters) -> list[dict]:
    def keep(row: dict) -> bool:
        return (
            (filters.since is None or row["time"] >= filters.since)
            and (filters.until is None or row["time"] < filters.until)
            and (not filters.reasons or row["reason"] in filters.reasons)
            and (filters.request_id is None or row["request_id"] == filters.request_id)
            and (filters.run_id is None or row["run_id"] == filters.run_id)
            and (not filters.key_prefix or row["key_hex"].startswith(filters.key_prefix.lower()))
        )

    return sorted(filter(keep, rows), key=lambda row: (row["time"], row["id"]), reverse=True)


def all_pages(engine: Engine, filters: EvictionFilters, page_size: int) -> list[int]:
    ids: list[int] = []
    cursor: Cursor | None = None
    while True:
        page = queries.eviction_log(engine, filters, page_size, after=cursor)
        assert len(page.rows) <= page_size
        ids.extend(page.rows["id"].tolist())
        if page.next_cursor is None:
            return ids
        assert len(page.rows) == page_size
        cursor = page.next_cursor


def filter_cases(run_ids: list[str]) -> list[EvictionFilters]:
    return [
        EvictionFilters(),
        EvictionFilters(since=BASE_TIME + 100.3, until=BASE_TIME + 500.7),
        EvictionFilters(reasons=("lru", "window")),
        EvictionFilters(request_id="req-3"),
        EvictionFilters(run_id=run_ids[1]),
        EvictionFilters(key_prefix="AB"),
        EvictionFilters(key_prefix="abc", reasons=("lru",), since=BASE_TIME + 30),
        EvictionFilters(since=BASE_TIME + 61, until=BASE_TIME + 62),  # inside one minute
        EvictionFilters(run_id="no-such-run"),
    ]


def test_eviction_log_filters_and_keyset_pages_cover_every_row_once(history) -> None:
    engine, rows, run_ids = history
    for filters in filter_cases(run_ids):
        expected = [row["id"] for row in matching(rows, filters)]
        assert queries.eviction_count(engine, filters) == len(expected), filters
        for page_size in (1, 7, 50, 1000):
            assert all_pages(engine, filters, page_size) == expected, (filters, page_size)


def test_eviction_log_rows_carry_what_operators_ask_for(history) -> None:
    engine, rows, _ = history
    page = queries.eviction_log(engine, page_size=3)
    assert list(page.rows.columns) == list(queries.EVICTION_COLUMNS)
    newest = matching(rows, EvictionFilters())[0]
    first = page.rows.iloc[0]
    assert first["id"] == newest["id"] and first["key_hex"] == newest["key_hex"] and first["reason"] == newest["reason"]
    assert page.next_cursor == Cursor(float(page.rows.iloc[-1]["time"]), int(page.rows.iloc[-1]["id"]))
    with pytest.raises(ValueError, match="hex"):
        queries.eviction_log(engine, EvictionFilters(key_prefix="xyz"))


def expected_bins(rows: list[dict], field: str, edges) -> list[int]:
    counts = [0] * (len(edges) + 1)
    for row in rows:
        if row[field] is not None:
            counts[sum(row[field] >= edge for edge in edges)] += 1
    return counts


def expected_over_time(rows: list[dict], bucket_seconds: float) -> list[tuple[float, str, int]]:
    counts = Counter((math.floor(row["time"] / bucket_seconds) * bucket_seconds, row["reason"]) for row in rows)
    return sorted((start, reason, count) for (start, reason), count in counts.items())


def assert_rollups_match_the_log(engine: Engine, filters: EvictionFilters) -> None:
    for histogram in (queries.age_at_eviction_histogram, queries.hits_before_eviction_histogram):
        assert histogram(engine, filters).equals(histogram(engine, filters, use_rollups=False)), filters
    for bucket in (60.0, 180.0):
        rolled = queries.evictions_over_time(engine, bucket, filters)
        assert rolled.equals(queries.evictions_over_time(engine, bucket, filters, use_rollups=False)), filters
    assert queries.eviction_count(engine, filters) == queries.eviction_count(engine, filters, use_rollups=False)


def test_aggregates_match_a_plain_count_of_the_log(history) -> None:
    engine, rows, run_ids = history
    for filters in filter_cases(run_ids):
        selected = matching(rows, filters)
        for use_rollups in (True, False):
            ages = queries.age_at_eviction_histogram(engine, filters, use_rollups=use_rollups)
            assert ages["evictions"].tolist() == expected_bins(selected, "age_s", AGE_EDGES_S), filters
            assert ages["bin_end"].tolist() == [*AGE_EDGES_S, math.inf]
            hits = queries.hits_before_eviction_histogram(engine, filters, use_rollups=use_rollups)
            assert hits["evictions"].tolist() == expected_bins(selected, "hit_count", HIT_EDGES), filters
            for bucket in (30.0, 60.0, 300.0):
                over_time = queries.evictions_over_time(engine, bucket, filters, use_rollups=use_rollups)
                assert list(over_time.itertuples(index=False, name=None)) == expected_over_time(selected, bucket)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    since=st.none() | st.floats(BASE_TIME - 10, BASE_TIME + 800),
    span=st.none() | st.floats(0.0, 600.0),
    reasons=st.sets(st.sampled_from(REASONS), max_size=2),
    run=st.sampled_from([None, 0, 1]),
)
def test_rollups_and_the_log_agree_for_any_time_range(history, since, span, reasons, run) -> None:
    engine, _, run_ids = history
    until = None if since is None or span is None else since + span
    filters = EvictionFilters(
        since=since, until=until, reasons=tuple(sorted(reasons)), run_id=None if run is None else run_ids[run]
    )
    assert_rollups_match_the_log(engine, filters)


def test_csv_export_holds_every_matching_row(history) -> None:
    engine, rows, run_ids = history
    filters = EvictionFilters(run_id=run_ids[0], reasons=("lru",))
    exported = list(csv.DictReader(io.StringIO(queries.export_evictions_csv(engine, filters, chunk_rows=9))))
    expected = matching(rows, filters)
    assert [int(row["id"]) for row in exported] == [row["id"] for row in expected]
    assert list(exported[0]) == list(queries.EVICTION_COLUMNS)
    assert {row["key_hex"] for row in exported} == {row["key_hex"] for row in expected}
    empty = queries.export_evictions_csv(engine, EvictionFilters(run_id="none"))
    assert empty.strip() == ",".join(queries.EVICTION_COLUMNS)


def test_request_timeline_hit_rate_and_recent_requests(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    run_id = writer.start_run(RUN_INFO)
    t = BASE_TIME
    writer.submit(
        [
            Event(EventKind.SUBMIT, 0, t, "a", None, 0, {}),
            Event(EventKind.SUBMIT, 0, t, "b", None, 0, {}),
            Event(EventKind.SCHEDULE, 1, t + 1, "a", None, 0, {"cached_tokens": 0, "computed_tokens": 32}),
            Event(EventKind.ALLOCATE, 1, t + 1, "a", 3, 16, {"block_ids": [3], "group": "full"}),
            Event(EventKind.FINISH, 2, t + 2, "a", None, 0, {"reason": "length", "output_tokens": 4}),
        ]
    )
    writer.record_requests(
        [
            request_view(
                "a", prompt_token_ids=list(range(32)), computed_tokens=32, first_scheduled_time=t + 1, arrival_time=t
            ),
            request_view(
                "b",
                prompt_token_ids=list(range(32)),
                cached_tokens=16,
                replay_from=16,
                hit_source="prefix",
                computed_tokens=16,
                first_scheduled_time=t + 61,
                arrival_time=t + 0.5,
            ),  # fmt: skip
            request_view("c", status="waiting", arrival_time=t + 2),  # not scheduled: no hit rate yet
        ]
    )
    assert writer.flush(timeout_s=10)
    engine = engine_for(db_url)
    timeline = queries.request_timeline(engine, "a", run_id)
    assert timeline["kind"].tolist() == ["submit", "schedule", "allocate", "finish"]
    assert timeline["detail"].iloc[1] == {"cached_tokens": 0, "computed_tokens": 32}
    assert queries.request_timeline(engine, "a", "other-run").empty
    rate = queries.hit_rate_over_time(engine, 60.0, run_id=run_id)
    assert rate["requests"].tolist() == [1, 1]
    assert rate["hit_rate"].tolist() == [0.0, 0.5]
    assert queries.hit_rate_over_time(engine, 3600.0)["hit_rate"].tolist() == [0.25]
    assert queries.recent_requests(engine, run_id, limit=2)["request_id"].tolist() == ["c", "b"]


def test_queries_accept_an_engine_a_connection_or_a_session(history) -> None:
    engine, rows, _ = history
    with engine.connect() as connection:
        assert queries.eviction_count(connection) == len(rows)
    with open_session(engine) as session:
        assert len(queries.eviction_log(session, page_size=5).rows) == 5
        assert queries.runs(session)["model"].tolist() == ["tiny", "tiny"]


def test_the_rollup_table_never_keeps_empty_minutes(history) -> None:
    engine, _, _ = history
    prune(engine, RetentionPolicy(max_age_days=None, max_events=None, max_evictions=10), now=BASE_TIME)
    with engine.connect() as connection:
        assert connection.scalar(select(func.min(ROLLUPS.c.evictions))) >= 1
        assert connection.scalar(select(func.sum(ROLLUPS.c.evictions))) == 10
    assert_rollups_match_the_log(engine, EvictionFilters())


def test_the_storage_package_imports_no_streamlit_and_no_torch() -> None:
    modules = "storage.write.writer_process, storage.write.writer_child, storage.read.queries"
    code = f"import sys, {modules}; print(sorted({{'streamlit', 'torch'}} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
