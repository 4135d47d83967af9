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
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import JSON, Column, Engine, Index, MetaData, String, Table, create_engine, func, insert, inspect, make_url, select, text
from sqlalchemy import column as sql_column
from sqlalchemy import table as sql_table
from sqlalchemy.exc import DBAPIError

from engine.events import Event, EventKind
from engine.request import HitSource, Request, RequestStatus, SamplingParams
from storage import migrate, queries
from storage.db import DB_URL_ENV, db_engine, default_db_url, open_session
from storage.models import (
    AGE_EDGES_S,
    EVENT_COLUMNS,
    EVENTS,
    HIT_EDGES,
    REQUESTS,
    ROLLUPS,
    Base,
    EventRecord,
    Eviction,
    Prune,
    Run,
)
from storage.queries import Cursor, EvictionFilters
from storage.retention import RetentionPolicy, prune
from storage.rows import event_values, request_row
from storage.writer import RunInfo, WriterOptions
from storage.writer_process import WriterProcess
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
    time.sleep(0.3)
    assert count_rows(engine_for(db_url), EVENTS) == 0  # still gathering its batch
    started = time.monotonic()
    assert writer.flush(timeout_s=10)
    assert time.monotonic() - started < 5
    assert count_rows(engine_for(db_url), EVENTS) == 5


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
    must equal what storage.rows builds for the generic path (PostgreSQL runs that path)."""
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
        if step % 10 == 0:
            time.sleep(0.01)
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


# An engine process that writes groups of events (one submit each, so one transaction each) until
# killed, printing the number of every group it knows to be committed. With a WriterProcess it first
# prints the writer process's pid.
KILLED_CHILD = """
import sys, time
from engine.events import Event, EventKind
from storage.writer import EventWriter, RunInfo, WriterOptions
from storage.writer_process import WriterProcess
from storage.retention import RetentionPolicy

url, size, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
options = WriterOptions(item_rows=size, batch_rows=size * 3, retention=RetentionPolicy(None, None, None))
writer = EventWriter(url, options) if kind == "thread" else WriterProcess(url, options)
if kind == "process":
    print(writer.pid, flush=True)
writer.start_run(RunInfo(model="m", num_blocks=8, block_size=16, dtype="float32", device="cpu"))
group = 0
while True:
    t = time.time()
    detail = {"reason": "lru", "key": "ab", "age_s": 1.0, "hit_count": 1}
    writer.submit([
        Event(EventKind.EVICT if i % 3 == 0 else EventKind.CACHE, group, t, f"group-{group}", i, 16, detail)
        for i in range(size)
    ])
    if group % 4 == 3:
        writer.flush()
        print(group, flush=True)
    group += 1
"""


def process_exited(pid: int) -> bool:
    """True once `pid` is gone or a zombie (an orphan's reaper may be slow)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_killed_writer_loses_only_unflushed_whole_batches(db_url: str, kind: str, engine_for) -> None:
    """Killing the engine's process (SIGKILL) mid-stream. A writer thread dies with it; a writer process
    sees its pipe close and writes everything it had received, then stops the run and exits."""
    size = 60
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, db_url, str(size), kind],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writer_pid = int(child.stdout.readline()) if kind == "process" else None
    flushed = -1
    try:
        deadline = time.monotonic() + 60
        while flushed < 40 and time.monotonic() < deadline:
            line = child.stdout.readline()
            assert line, f"the child died: {child.stderr.read()}"
            flushed = int(line)
        time.sleep(random.Random(7).uniform(0.0, 0.05))  # land the kill somewhere mid-stream
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    assert flushed >= 40
    if writer_pid is not None:
        assert wait_for(lambda: process_exited(writer_pid), timeout_s=60)

    engine = engine_for(db_url)
    if make_url(db_url).get_backend_name() == "sqlite":
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
    with engine.connect() as connection:
        events = dict(
            connection.execute(select(EventRecord.request_id, func.count()).group_by(EventRecord.request_id)).all()
        )
        evictions = Counter(
            dict(connection.execute(select(Eviction.request_id, func.count()).group_by(Eviction.request_id)).all())
        )
    groups = sorted(int(name.removeprefix("group-")) for name in events)
    assert groups == list(range(len(groups)))  # commits are in order: no gaps
    assert groups[-1] >= flushed  # everything flushed survived
    assert all(count == size for count in events.values())  # every group whole ...
    assert all(evictions[name] == size // 3 for name in events)  # ... with its eviction rows
    assert queries.eviction_count(engine) == sum(evictions.values())  # and rollups
    if writer_pid is not None:
        with engine.connect() as connection:
            assert connection.scalar(select(Run.stopped_at)) is not None  # it closed the run on its way out


def test_a_dead_writer_process_is_reported_and_its_rows_counted(tmp_path: Path, engine_for) -> None:
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = WriterProcess(url, WriterOptions(**FAST))
    writer.start_run(RUN_INFO)
    writer.submit([cache(i, BASE_TIME) for i in range(10)])
    assert writer.flush(timeout_s=20)
    os.kill(writer.pid, signal.SIGKILL)
    assert wait_for(lambda: writer.stats().last_error is not None)
    writer.submit([cache(i, BASE_TIME) for i in range(10, 15)])  # the engine keeps serving
    writer.record_requests([request_view("a")])
    stats = writer.stats()
    assert "writer process exited" in stats.last_error and not stats.retrying
    assert stats.written_events == 10 and stats.dropped == 6 and stats.queued == 0
    assert writer.flush(timeout_s=5) and writer.close(timeout_s=5)
    assert count_rows(engine_for(url), EVENTS) == 10


def test_a_stalled_writer_process_never_blocks_the_engine(tmp_path: Path, engine_for) -> None:
    """With the child stopped (SIGSTOP), submits still return at once: frames fill the pipe, then a
    bounded backlog, then are dropped and counted. Once it runs again, everything accepted is written."""
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = WriterProcess(url, WriterOptions(**FAST, queue_items=4, item_rows=100, batch_interval_s=0.0))
    writer.start_run(RUN_INFO)
    assert writer.flush(timeout_s=20)
    os.kill(writer.pid, signal.SIGSTOP)
    padding = {"note": "x" * 2000}  # ~200 kB a frame, so a few frames fill the pipe
    batches = [
        [Event(EventKind.CACHE, b, BASE_TIME, "req-0", i, 16, padding) for i in range(100)] for b in range(40)
    ]
    submitter = threading.Thread(target=lambda: [writer.submit(batch) for batch in batches])
    try:
        submitter.start()
        submitter.join(timeout=60)
        assert not submitter.is_alive(), "submit waited for the stopped writer process"
        stats = writer.stats()
        assert stats.dropped > 0 and stats.dropped % 100 == 0  # whole frames
        assert stats.dropped + stats.queued == 4000
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    assert writer.flush(timeout_s=60)
    stats = writer.stats()
    assert stats.written_events + stats.dropped == 4000 and stats.queued == 0
    assert count_rows(engine_for(url), EVENTS) == stats.written_events
    assert writer.close(timeout_s=20)


def test_a_record_that_cannot_reach_the_writer_process_is_counted_and_the_rest_flows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = WriterProcess(url, WriterOptions(**FAST, batch_interval_s=30.0))
    writer.start_run(RUN_INFO)
    writer.record_requests([request_view("a", replay_divergence=threading.Lock())])  # cannot be pickled
    assert writer.flush(timeout_s=20)
    stats = writer.stats()
    assert stats.dropped == 1 and "could not be sent" in stats.last_error and "lock" in stats.last_error
    writer.submit([cache(i, BASE_TIME) for i in range(5)])
    writer.record_requests([request_view("b")])
    assert writer.flush(timeout_s=20)
    stats = writer.stats()
    assert (stats.written_events, stats.written_requests, stats.dropped, stats.queued) == (5, 1, 1, 0)
    assert writer.close(timeout_s=20)


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


@contextmanager
def write_lock(url: str) -> Iterator[None]:
    """Hold a lock that keeps every other connection from writing the events table."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        connection = sqlite3.connect(parsed.database, isolation_level=None)
        connection.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            connection.execute("ROLLBACK")
            connection.close()
        return
    engine = create_engine(url)
    with engine.connect() as connection:
        connection.execute(text("LOCK TABLE events IN ACCESS EXCLUSIVE MODE"))
        try:
            yield
        finally:
            connection.rollback()
    engine.dispose()


def test_a_locked_database_is_reported_and_the_writer_recovers(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url, busy_timeout_ms=50, max_attempts=2)
    writer.start_run(RUN_INFO)
    assert writer.flush(timeout_s=10)
    with write_lock(db_url):
        started = time.perf_counter()
        for step in range(5):
            writer.submit([cache(step * 10 + i, BASE_TIME + step) for i in range(10)])
        assert time.perf_counter() - started < 0.5  # the engine side never waits on the database
        assert wait_for(lambda: writer.stats().failed_batches >= 1)
        assert writer.flush(timeout_s=20)
        stats = writer.stats()
        assert stats.dropped == 50 and stats.written_events == 0 and stats.queued == 0
        assert "lock" in stats.last_error.lower()
    writer.submit([cache(100 + i, BASE_TIME + 10) for i in range(10)])
    assert writer.flush(timeout_s=10)
    stats = writer.stats()
    assert stats.written_events == 10 and stats.dropped == 50 and not stats.retrying
    assert count_rows(engine_for(db_url), EVENTS) == 10


def test_a_lock_released_within_the_retries_loses_nothing(db_url: str, make_writer) -> None:
    writer = make_writer(db_url, busy_timeout_ms=50, max_attempts=100)
    writer.start_run(RUN_INFO)
    assert writer.flush(timeout_s=10)
    with write_lock(db_url):
        writer.submit([evict(i, BASE_TIME + i) for i in range(10)])
        assert wait_for(lambda: writer.stats().retrying)
    assert writer.flush(timeout_s=20)
    stats = writer.stats()
    assert stats.written_events == 10 and stats.dropped == 0 and stats.retries >= 1 and not stats.retrying


def read_only_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return f"sqlite:///file:{parsed.database}?mode=ro&uri=true"
    options = {"options": "-c default_transaction_read_only=on"}
    return parsed.update_query_dict(options).render_as_string(hide_password=False)


def test_a_read_only_database_is_reported_not_raised(db_url: str, make_writer) -> None:
    migrate.upgrade(db_url)
    writer = make_writer(read_only_url(db_url), max_attempts=2)
    writer.start_run(RUN_INFO)
    writer.submit([cache(i, BASE_TIME) for i in range(7)])
    writer.record_requests([request_view("a")])
    assert writer.flush(timeout_s=20)
    stats = writer.stats()
    assert stats.schema_ready and stats.written_events == 0
    assert stats.dropped == 8 and stats.failed_batches >= 1
    assert "read" in stats.last_error.lower() and "only" in stats.last_error.lower()
    assert writer.close(timeout_s=20)


@pytest.mark.parametrize(
    "url",
    ["sqlite:///{tmp}/a-file/history.sqlite", "postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2"],
    ids=["sqlite", "postgresql"],
)
def test_an_unreachable_database_is_reported_and_everything_counted(url: str, tmp_path: Path, make_writer) -> None:
    (tmp_path / "a-file").write_text("a file where the database directory should be")
    writer = make_writer(url.format(tmp=tmp_path), queue_items=3, item_rows=10)
    writer.start_run(RUN_INFO)
    for step in range(5):
        writer.submit([cache(step * 10 + i, BASE_TIME) for i in range(10)])
    stats = writer.stats()
    assert not stats.schema_ready
    assert stats.dropped + stats.queued == 50
    # The writer's queue holds at most 3 items of 10 (a WriterProcess's child reports its drops a moment later).
    assert wait_for(lambda: writer.stats().dropped >= 20)
    assert wait_for(lambda: writer.stats().last_error is not None and writer.stats().retrying)
    assert writer.close(timeout_s=20)
    stats = writer.stats()
    assert stats.dropped == 50 and stats.queued == 0 and stats.written_events == 0


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
    modules = "storage.writer_process, storage.queries"
    code = f"import sys, {modules}; print(sorted({{'streamlit', 'torch'}} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
