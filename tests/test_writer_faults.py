"""Writer faults injected against real processes and real databases, with every row accounted for.

Each test breaks something a deployed console meets (a killed or stopped writer process, a killed engine
process, a database locked by another process, stopped, full, read-only or unreachable, a submit racing
close) and asserts exact counts: the rows written (counted in the database itself) plus the rows the
writer counts as dropped equal the rows handed to it. The fixtures are in tests/storage_support.py.
"""

from __future__ import annotations

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
from sqlalchemy import Connection, Engine as Database, create_engine, event, func, make_url, select, text

from engine.core.config import EngineConfig
from engine.engine import Engine
from engine.core.events import Event, EventKind
from engine.core.request import SamplingParams
from storage import migrate
from storage.read import queries
from storage.schema import EVENTS, FLEET_BLOCKS, FLEET_EVENTS, FLEET_SOURCES, EventRecord, Eviction, Run
from storage.write.fleet_bulk import write_fleet_rows
from storage.write.fleet_rows import FleetRowBuilder, FleetRows
from storage.write.recorder import record_engine
from storage.write.writer import WriterOptions
from storage.write.writer_process import WriterProcess
from tests.fleet_history_support import batch, pod_source, stored
from tests.storage_support import (
    BASE_TIME,
    FAST,
    NO_RETENTION,
    REPO,
    RUN_INFO,
    cache,
    count_rows,
    evict,
    fill_disk,
    request_view,
    wait_for,
)

# An engine process that writes groups of events (one submit each, so one transaction each) until
# killed, printing the number of every group it knows to be committed. With a WriterProcess it first
# prints the writer process's pid.
KILLED_CHILD = """
import sys, time
from engine.core.events import Event, EventKind
from storage.write.writer import EventWriter, RunInfo, WriterOptions
from storage.write.writer_process import WriterProcess
from storage.write.retention import RetentionPolicy

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
    writer = make_writer(db_url, busy_timeout_ms=50, retry_for_s=0.3)
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
    writer = make_writer(db_url, busy_timeout_ms=50, retry_for_s=60.0)
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
    writer = make_writer(read_only_url(db_url), retry_for_s=0.3)
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




def test_a_database_of_a_newer_schema_is_given_up_at_once_and_every_row_counted(db_url: str, make_writer, engine_for):
    # Before: Alembic's "Can't locate revision" was retried for ever, as if the database were down.
    engine = engine_for(db_url)
    migrate.upgrade(engine)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))  # a newer release's schema
    with pytest.raises(migrate.SchemaTooNewError, match="9999"):
        migrate.upgrade(engine)
    writer = make_writer(db_url)
    assert wait_for(lambda: writer.stats().last_error is not None)
    stats = writer.stats()
    assert "SchemaTooNewError" in stats.last_error and "9999" in stats.last_error
    assert not stats.retrying and stats.retries == 0 and not stats.schema_ready
    writer.start_run(RUN_INFO)
    writer.submit([cache(i, BASE_TIME) for i in range(7)])
    writer.record_requests([request_view("a")])
    assert writer.flush(timeout_s=20)
    assert wait_for(lambda: writer.stats().dropped == 8)
    stats = writer.stats()
    assert stats.queued == 0 and stats.written_events == 0 and stats.retries == 0
    assert writer.close(timeout_s=20)
    assert migrate.current_revision(engine) == "9999"
    assert count_rows(engine, EVENTS) == 0


# ---------------------------------------------------------------- the writer process killed while the engine runs


class PublishedRows:
    """An engine listener that counts what the engine hands its listeners: the rows the writer is given."""

    def __init__(self) -> None:
        self.rows = 0
        self.last_step = 0

    def __call__(self, events: list[Event], views: list) -> None:
        self.rows += len(events) + len(views)
        if events:
            self.last_step = max(self.last_step, events[-1].step)


def submit_requests(engine: Engine, rng: random.Random, count: int) -> None:
    """`count` requests on fresh prompts of three blocks, so the pool keeps evicting."""
    for _ in range(count):
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(40)]
        engine.submit(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))


def test_a_killed_writer_process_is_replaced_and_every_row_is_counted(db_url: str, make_model, engine_for) -> None:
    """SIGKILL of the writer process while the engine runs: a new one starts and history goes on; the rows
    the dead one had not committed count as dropped, exactly (the new one reads what was committed)."""
    writer = WriterProcess(db_url, WriterOptions(**FAST))
    engine = Engine(EngineConfig(model="tiny-llama", num_blocks=64, block_size=16), loaded=make_model("tiny-llama"))
    published = PublishedRows()
    engine.add_listener(published)
    record_engine(engine, writer)
    rng = random.Random(3)
    engine.start()
    try:
        submit_requests(engine, rng, 8)
        assert wait_for(lambda: writer.stats().written_events > 0, timeout_s=60)
        first_pid = writer.pid
        submit_requests(engine, rng, 8)
        os.kill(first_pid, signal.SIGKILL)  # with rows held, in the pipe and in its queue
        submit_requests(engine, rng, 8)  # the engine keeps serving
        assert wait_for(lambda: writer.stats().restarts == 1 and writer.stats().schema_ready, timeout_s=60)
        step_at_restart = published.last_step
        submit_requests(engine, rng, 8)
        assert wait_for(lambda: not engine.has_work(), timeout_s=120)
    finally:
        engine.stop()
    assert writer.close(timeout_s=60)
    stats = writer.stats()
    assert writer.pid != first_pid and "exited (code -9)" in stats.last_error
    assert stats.queued == 0
    assert stats.written_events + stats.written_requests + stats.dropped == published.rows
    history = engine_for(db_url)
    assert count_rows(history, EVENTS) == stats.written_events
    with history.connect() as connection:
        evict_events = connection.scalar(select(func.count()).select_from(EVENTS).where(EVENTS.c.kind == "evict"))
        newest_step = connection.scalar(select(func.max(EVENTS.c.step)))
    assert evict_events > 0 and queries.eviction_count(history, use_rollups=False) == evict_events  # whole items
    assert newest_step > step_at_restart  # history went on after the restart


def test_a_writer_process_killed_again_and_again_keeps_its_counts_exact(tmp_path: Path, engine_for) -> None:
    """Three children killed in a row, the last two right after they started (they restart after a
    backoff then): every row handed over is written or counted, and the database agrees."""
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = WriterProcess(url, WriterOptions(**FAST))
    writer.start_run(RUN_INFO)
    submitted = 0
    for restart in range(1, 4):
        writer.submit([evict(submitted + i, BASE_TIME) for i in range(30)])
        submitted += 30
        if restart == 1:
            assert writer.flush(timeout_s=30)
        os.kill(writer.pid, signal.SIGKILL)
        assert wait_for(lambda: writer.stats().restarts == restart, timeout_s=60)
    writer.submit([evict(submitted + i, BASE_TIME) for i in range(30)])
    submitted += 30
    assert writer.flush(timeout_s=60)
    stats = writer.stats()
    assert stats.written_events >= 60 and stats.queued == 0  # the first flushed 30 and the last 30 at least
    assert stats.written_events + stats.dropped == submitted
    assert count_rows(engine_for(url), EVENTS) == stats.written_events
    assert writer.close(timeout_s=30)


# ---------------------------------------------------------------- the fleet's rows when the writer process dies


def write_fleet_rows_then_die(connection: Connection, units: list[FleetRows]) -> None:
    """`write_fleet_rows`, then SIGKILL of this process once the transaction has committed (as its connection
    goes back to the pool): a writer process that dies with rows committed and never reported."""
    write_fleet_rows(connection, units)
    event.listen(connection.engine.pool, "checkin", lambda *_: os.kill(os.getpid(), signal.SIGKILL), once=True)


def stored_batches(builder: FleetRowBuilder, first: int, count: int) -> list[FleetRows]:
    """Batches `first`.. of pod "a", each storing two new blocks: three rows (an event, two lifetimes)."""
    return [builder.batch(batch("a", seq, stored([2 * seq + 1, 2 * seq + 2]))) for seq in range(first, first + count)]


def fleet_rows_in(db: Database) -> int:
    """The rows of the tables that opened pods and stored batches fill."""
    return sum(count_rows(db, table) for table in (FLEET_SOURCES, FLEET_EVENTS, FLEET_BLOCKS))


def test_fleet_rows_a_killed_writer_process_had_committed_count_as_written(db_url: str, engine_for) -> None:
    """Regression: the rows handed in through submit_rows (the fleet's) were not in the saved totals, so
    those a killed writer process had committed, but not yet reported, counted as dropped. Here the child
    dies right after committing a unit, before any report of it: every row is in the database, none is
    counted as dropped."""
    writer = WriterProcess(db_url, WriterOptions(**FAST))
    builder = FleetRowBuilder("collector")
    before = [builder.open(pod_source("a"), 50.0), *stored_batches(builder, 0, 5)]
    for unit in before:
        assert writer.submit_rows(unit, unit.num_rows, write_fleet_rows)
    assert writer.flush(timeout_s=30)
    first_pid = writer.pid
    (last,) = stored_batches(builder, 5, 1)
    assert writer.submit_rows(last, last.num_rows, write_fleet_rows_then_die)
    assert wait_for(lambda: writer.stats().restarts == 1 and writer.stats().schema_ready, timeout_s=60)
    after = stored_batches(builder, 6, 5)
    for unit in after:
        assert writer.submit_rows(unit, unit.num_rows, write_fleet_rows)
    assert writer.flush(timeout_s=30)
    assert writer.close(timeout_s=30)
    stats = writer.stats()
    assert writer.pid != first_pid and "exited (code -9)" in stats.last_error
    handed_over = sum(unit.num_rows for unit in [*before, last, *after])
    assert (stats.written_other, stats.dropped, stats.queued) == (handed_over, 0, 0)
    assert fleet_rows_in(engine_for(db_url)) == handed_over == 1 + 11 * 3


def test_a_writer_process_killed_while_fleet_rows_stream_in_keeps_their_counts_exact(
    tmp_path: Path, engine_for
) -> None:
    """SIGKILL from outside, twice, after some commits and with more units in the pipe and the child's
    queue: every fleet row handed over is written or counted as dropped, and the written ones are the
    rows in the database."""
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    writer = WriterProcess(url, WriterOptions(**FAST))
    builder = FleetRowBuilder("collector")
    opened = builder.open(pod_source("a"), 50.0)
    assert writer.submit_rows(opened, opened.num_rows, write_fleet_rows, wait=True)
    assert writer.flush(timeout_s=30)
    handed_over, seq = opened.num_rows, 0
    for restart in (1, 2):
        committed = writer.stats().written_other
        for unit in stored_batches(builder, seq, 10):
            assert writer.submit_rows(unit, unit.num_rows, write_fleet_rows, wait=True)
            handed_over += unit.num_rows
        assert wait_for(lambda: writer.stats().written_other > committed, timeout_s=60)  # some are committed
        for unit in stored_batches(builder, seq + 10, 10):  # and these are on their way
            assert writer.submit_rows(unit, unit.num_rows, write_fleet_rows, wait=True)
            handed_over += unit.num_rows
        seq += 20
        os.kill(writer.pid, signal.SIGKILL)
        assert wait_for(lambda: writer.stats().restarts == restart and writer.stats().schema_ready, timeout_s=60)
    assert writer.flush(timeout_s=30)
    assert writer.close(timeout_s=30)
    stats = writer.stats()
    assert stats.queued == 0 and stats.written_other + stats.dropped == handed_over
    assert fleet_rows_in(engine_for(url)) == stats.written_other


# ---------------------------------------------------------------- the database locked, stopped, full, read-only

# Another process holding SQLite's write lock for argv[2] seconds (it says "locked" once it holds it).
LOCK_HOLDER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
connection.execute("ROLLBACK")
"""


def test_a_database_locked_for_30_seconds_by_another_process_loses_nothing(tmp_path: Path, engine_for) -> None:
    """The console's writer settings (retried for 120 s, 2,048 frames of room): rows handed over while
    another process holds the write lock wait, and are all written once it lets go; readers read on."""
    path = tmp_path / "history.sqlite"
    url = f"sqlite:///{path}"
    writer = WriterProcess(url, WriterOptions(retention=NO_RETENTION))
    writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME) for i in range(20)])
    assert writer.flush(timeout_s=30)
    reader = engine_for(url)
    submitted, most_queued, saw_retrying = 20, 0, False
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        locked_until = time.monotonic() + 30  # the holder lets go no sooner than this
        reads = 0
        while holder.poll() is None:  # an engine's pace until the other process lets go
            writer.submit([evict(submitted + i, BASE_TIME) for i in range(20)])
            submitted += 20
            stats = writer.stats()
            most_queued, saw_retrying = max(most_queued, stats.queued), saw_retrying or stats.retrying
            if time.monotonic() < locked_until - 5:  # the console reads throughout (while the lock surely holds)
                assert queries.eviction_count(reader, use_rollups=False) == 20
                reads += 1
            try:
                holder.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        assert reads > 0
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert holder.returncode == 0
    assert saw_retrying and most_queued > 1000 and "locked" in writer.stats().last_error
    assert writer.flush(timeout_s=60)
    stats = writer.stats()
    assert (stats.written_events, stats.dropped, stats.queued) == (submitted, 0, 0)
    assert count_rows(reader, EVENTS) == queries.eviction_count(reader, use_rollups=False) == submitted
    assert writer.close(timeout_s=30)


def test_postgresql_stopped_and_started_again_the_writer_reconnects(
    postgres_control, postgres_url: str, engine_for
) -> None:
    writer = WriterProcess(postgres_url, WriterOptions(**FAST))
    writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME) for i in range(10)])
    assert writer.flush(timeout_s=30)
    postgres_control.stop()
    try:
        writer.submit([evict(10 + i, BASE_TIME) for i in range(10)])  # returns at once: the engine keeps serving
        assert wait_for(lambda: writer.stats().retrying, timeout_s=30)
        assert writer.stats().queued == 10
    finally:
        postgres_control.start()
    assert writer.flush(timeout_s=60)  # the same writer, reconnected: no restart of anything but the server
    stats = writer.stats()
    assert (stats.written_events, stats.dropped, stats.queued, stats.restarts) == (20, 0, 0, 0)
    assert stats.retries >= 1 and not stats.retrying
    assert count_rows(engine_for(postgres_url), EVENTS) == 20
    assert writer.close(timeout_s=30)


def test_a_full_disk_is_reported_every_row_counted_and_the_writer_recovers(small_disk: Path, engine_for) -> None:
    """A real full file system (a 1 MiB tmpfs filled up): SQLITE_FULL, rows dropped after the retries and
    counted exactly; once space is freed, the same writer writes again."""
    url = f"sqlite:///{small_disk / 'history.sqlite'}"
    migrate.upgrade(url)
    filler = fill_disk(small_disk, leave_bytes=64 * 1024)  # room to open it (a 32 kB -shm file), not to grow
    writer = WriterProcess(url, WriterOptions(**FAST, retry_for_s=1.0))
    writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME, note="x" * 200) for i in range(1000)])  # far more than fits
    writer.record_requests([request_view("a")])
    assert wait_for(lambda: "full" in (writer.stats().last_error or ""), timeout_s=30)
    writer.submit([cache(i, BASE_TIME) for i in range(5)])  # the engine keeps serving
    assert writer.flush(timeout_s=30)
    stats = writer.stats()
    assert stats.dropped > 0 and stats.failed_batches >= 1 and stats.queued == 0
    assert "database or disk is full" in stats.last_error
    history = engine_for(url)
    assert count_rows(history, EVENTS) == stats.written_events  # the console still reads, and agrees
    assert stats.written_events + stats.written_requests + stats.dropped == 1006
    filler.unlink()
    writer.submit([cache(100 + i, BASE_TIME) for i in range(10)])
    assert writer.flush(timeout_s=30)
    assert writer.stats().written_events == stats.written_events + 10 == count_rows(history, EVENTS)
    assert writer.close(timeout_s=30)


def writes_ignore_file_modes(directory: Path) -> bool:
    """True if this process may write a file whose mode forbids it (root, with CAP_DAC_OVERRIDE)."""
    probe = directory / "mode-probe"
    probe.write_text("")
    probe.chmod(0o444)
    try:
        probe.open("a").close()
    except PermissionError:
        return False
    return True


def test_a_history_file_made_read_only_is_reported_and_every_row_counted(tmp_path: Path, engine_for) -> None:
    if writes_ignore_file_modes(tmp_path):
        pytest.skip("this process writes files whatever their mode (root)")
    path = tmp_path / "history.sqlite"
    migrate.upgrade(f"sqlite:///{path}")
    path.chmod(0o444)
    writer = WriterProcess(f"sqlite:///{path}", WriterOptions(**FAST, retry_for_s=1.0))
    writer.start_run(RUN_INFO)
    writer.submit([evict(i, BASE_TIME) for i in range(10)])
    assert writer.flush(timeout_s=30)
    stats = writer.stats()
    assert (stats.written_events, stats.dropped, stats.queued) == (0, 10, 0)
    assert "readonly" in stats.last_error
    assert writer.close(timeout_s=30)


# ---------------------------------------------------------------- submit racing close


def test_a_submit_racing_close_is_written_unless_it_was_refused(tmp_path: Path, engine_for) -> None:
    """Regression: a submit taken in while close ran from another thread could be held after close had
    sent its last frame, and never written (counted as dropped only once the child had exited; in one to
    five of ten trials, depending on the machine's load). Now a submit either joins close's last frame or
    is refused at the call: the only rows dropped are those refused, and every other row is in the
    database."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for trial in range(12):
            url = f"sqlite:///{tmp_path / f'history-{trial}.sqlite'}"
            writer = WriterProcess(url, WriterOptions(**FAST, item_rows=1, queue_items=100_000))
            writer.start_run(RUN_INFO)
            assert writer.flush(timeout_s=30)
            refused: list[int] = []  # rows each submit saw dropped at once (the writer was closed)

            def submit_rows(writer: WriterProcess = writer, refused: list[int] = refused) -> None:
                for i in range(2000):
                    before = writer.stats().dropped
                    writer.submit([cache(2 * i, BASE_TIME), cache(2 * i + 1, BASE_TIME)])  # two chunks of one
                    refused.append(writer.stats().dropped - before)

            submitter = threading.Thread(target=submit_rows)
            submitter.start()
            assert wait_for(lambda: len(refused) > 50 * trial, timeout_s=60)  # close somewhere mid-stream
            assert writer.close(timeout_s=60)
            submitter.join(timeout=120)
            assert not submitter.is_alive()
            stats = writer.stats()
            assert (stats.queued, stats.dropped) == (0, sum(refused)), trial
            assert stats.written_events == 4000 - sum(refused) == count_rows(engine_for(url), EVENTS)
    finally:
        sys.setswitchinterval(switch_interval)
