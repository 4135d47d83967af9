"""Fixtures and builders for the history-store tests (registered from tests/conftest.py; no tests here).

Every test that takes `db_url` runs once per backend. The PostgreSQL server comes from
$PREFIX_CONSOLE_TEST_PG_URL, else `.ci/start-postgres` starts one for the session; without server
binaries the postgresql cases fail under CI (CI=true) and are skipped locally. `postgres_control` stops
and starts the session's own server (tests that take it skip with an external one).
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, make_url, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.schema import CreateSchema, DropSchema

from engine.core.events import Event, EventKind, EvictReason
from engine.core.snapshot import RequestView
from storage.db import db_engine
from storage.write.retention import RetentionPolicy
from storage.write.writer import EventWriter, RunInfo, WriterOptions
from storage.write.writer_process import WriterProcess

REPO = Path(__file__).resolve().parents[1]
PG_URL_ENV = "PREFIX_CONSOLE_TEST_PG_URL"
LATEST_REVISION = "0010"  # the newest migration: a database upgraded to head is at this revision
SCHEMA_LOCK_WAIT_S = 60  # how long a test's fresh schema waits for an earlier test's locks
OTHER_SESSIONS = text(
    "SELECT pid, application_name, state, xact_start, left(query, 200) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)
BASE_TIME = 1_750_000_017.25  # not on a minute boundary, so time filters cut minutes
NO_RETENTION = RetentionPolicy(max_age_days=None, max_events=None, max_evictions=None)
FAST = {
    "first_backoff_s": 0.01,
    "max_backoff_s": 0.05,
    "poll_s": 0.02,
    "busy_timeout_ms": 200,
    "retention": NO_RETENTION,
}
RUN_INFO = RunInfo(model="tiny", num_blocks=64, block_size=16, dtype="float32", device="cpu", started_at=BASE_TIME)
REASONS = [reason.value for reason in EvictReason]
# What `request_view` fills in for every field it is not given: a finished 3-token request of no hit.
VIEW_DEFAULTS: dict[str, Any] = {
    "parent_id": None,
    "status": "finished",
    "retain": False,
    "salt": None,
    "prompt_token_ids": (1, 2, 3),
    "output_token_ids": (),
    "num_computed_tokens": 0,
    "cached_tokens": 0,
    "computed_tokens": 0,
    "hit_source": "none",
    "cow_copies": 0,
    "preemptions": 0,
    "finish_reason": None,
    "arrival_time": BASE_TIME,
    "first_scheduled_time": None,
    "first_token_time": None,
    "finish_time": None,
    "block_tables": {},
    "max_new_tokens": 16,
    "window_start": 0,
    "window_end": 0,
    "replay_from": 0,
    "replay_mode": "none",
    "replayed_tokens": 0,
    "replay_divergence": None,
    "block_keys": None,
    "content_keys": None,
}


# ---------------------------------------------------------------- builders


def request_view(request_id: str, **fields: Any) -> RequestView:
    """A RequestView as the engine would publish it: VIEW_DEFAULTS, overridden by `fields`.

    `num_prompt_tokens` defaults to the prompt's length; token lists become tuples, as in the engine's views.
    """
    values = {**VIEW_DEFAULTS, **fields, "request_id": request_id}
    for name in ("prompt_token_ids", "output_token_ids"):
        values[name] = tuple(values[name])
    values.setdefault("num_prompt_tokens", len(values["prompt_token_ids"]))
    return RequestView(**values)


def evict(index: int, t: float, **detail: Any) -> Event:
    """An EVICT event of block `index % 64`, with the detail fields the block pool sends."""
    values = {
        "reason": EvictReason.LRU.value,
        "key": f"{index:016x}",
        "start_pos": 0,
        "end_pos": 16,
        "age_s": 1.0,
        "hit_count": 0,
        "last_used": t,
        "group": "full",
    }
    values.update(detail)
    return Event(EventKind.EVICT, index, t, f"req-{index % 7}", index % 64, 16, values)


def cache(index: int, t: float, request_id: str = "req-0") -> Event:
    return Event(EventKind.CACHE, index, t, request_id, index % 64, 16, {"key": f"{index:016x}", "group": "full"})


def count_rows(engine: Engine, table) -> int:
    with engine.connect() as connection:
        return connection.scalar(select(func.count()).select_from(table))


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------- databases


def postgres_bin_dir() -> Path | None:
    """The newest installed PostgreSQL server's bin directory (Debian layout), if any."""
    found = [path.parent for path in Path("/usr/lib/postgresql").glob("*/bin/initdb") if path.parts[-3].isdigit()]
    return max(found, key=lambda path: int(path.parts[-2]), default=None)


@dataclass(frozen=True)
class ThrowawayPostgres:
    """The server `.ci/start-postgres` started for this session, which tests may stop and start again."""

    url: str
    directory: Path  # holds data/ and the server's socket; the script's DIR
    bin_dir: Path

    def stop(self) -> None:
        """Stop the server (fast shutdown: open connections are cut, as in a crash of the server)."""
        self._pg_ctl("stop", "-m", "fast")

    def start(self) -> None:
        """Start it again, as the script did: same port, socket directory and log."""
        port = make_url(self.url).port
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {self.directory}"
        self._pg_ctl("start", "-w", "-t", "60", "-l", str(self.directory / "server.log"), "-o", options)

    def is_running(self) -> bool:
        return self._pg_ctl("status", check=False).returncode == 0

    def _pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bin_dir / "pg_ctl"), "-D", str(self.directory / "data"), *args]
        if os.geteuid() == 0:  # the server runs as `postgres` (initdb refuses root)
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=90, check=check)


@pytest.fixture(scope="session")
def throwaway_postgres() -> Iterator[ThrowawayPostgres | None]:
    """The session's own PostgreSQL server, or None when $PREFIX_CONSOLE_TEST_PG_URL names one."""
    if os.environ.get(PG_URL_ENV):
        yield None
        return
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        reason = f"no PostgreSQL server binaries and no ${PG_URL_ENV} (`make system-deps` installs postgresql)"
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(reason)
        pytest.skip(reason)
    directory = Path(tempfile.mkdtemp(prefix="prefix-console-pg-"))  # not under pytest's root-only tmp
    started = subprocess.run(
        [str(REPO / ".ci" / "start-postgres"), str(directory)], capture_output=True, text=True, timeout=180
    )
    if started.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.fail(f".ci/start-postgres failed: {started.stderr}")
    server = ThrowawayPostgres(started.stdout.split()[-1], directory, bin_dir)
    try:
        yield server
    finally:
        if server.is_running():
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server(throwaway_postgres: ThrowawayPostgres | None) -> str:
    """URL of a PostgreSQL server: $PREFIX_CONSOLE_TEST_PG_URL, else one started for this session."""
    return os.environ[PG_URL_ENV] if throwaway_postgres is None else throwaway_postgres.url


@pytest.fixture
def postgres_control(throwaway_postgres: ThrowawayPostgres | None, postgres_server: str) -> Iterator[ThrowawayPostgres]:
    """The session's server, for a test that stops it; running again after the test, whatever happened."""
    if throwaway_postgres is None:
        pytest.skip(f"${PG_URL_ENV} names an external server, which tests do not stop")
    yield throwaway_postgres
    if not throwaway_postgres.is_running():
        throwaway_postgres.start()


@pytest.fixture(scope="session")
def postgres_database(postgres_server: str) -> Iterator[str]:
    """URL of a database created on the server for this test session, dropped at its end."""
    name = f"prefix_console_test_{secrets.token_hex(4)}"
    admin = create_engine(postgres_server, isolation_level="AUTOCOMMIT", pool_pre_ping=True)  # survives restarts
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))  # a generated identifier: DDL takes no parameters
    try:
        yield make_url(postgres_server).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, or a fresh schema in the session's PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'history.sqlite'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def postgres_url(postgres_database: str) -> str:
    """The session's PostgreSQL database with a fresh, empty schema.

    Dropping the schema waits for every lock on its tables. A session an earlier test left open in a
    transaction would make it wait for ever, so it waits SCHEMA_LOCK_WAIT_S and then fails, naming the
    sessions still connected.
    """
    engine = create_engine(postgres_database, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text(f"SET lock_timeout = '{SCHEMA_LOCK_WAIT_S}s'"))
            try:
                connection.execute(DropSchema("public", cascade=True, if_exists=True))
            except OperationalError as error:
                others = connection.execute(OTHER_SESSIONS).all()
                pytest.fail(f"the schema is still locked after {SCHEMA_LOCK_WAIT_S} s ({error.orig}); sessions: {others}")
            connection.execute(CreateSchema("public"))
    finally:
        engine.dispose()
    return postgres_database


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 1 MiB tmpfs of its own, to fill up. Mounting needs root: skipped otherwise."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0777", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], capture_output=True)


def fill_disk(directory: Path, leave_bytes: int) -> Path:
    """Fill the file system of `directory` up to `leave_bytes` of free space; returns the filler file."""
    stat = os.statvfs(directory)
    filler = directory / "filler"
    filler.write_bytes(b"\0" * max(stat.f_bavail * stat.f_frsize - leave_bytes, 0))
    return filler


@pytest.fixture
def engine_for() -> Iterator[Callable[[str], Engine]]:
    """`engine_for(url)`: a SQLAlchemy engine from `storage.db.db_engine`, disposed after the test."""
    engines: list[Engine] = []

    def make(url: str) -> Engine:
        engines.append(db_engine(url))
        return engines[-1]

    yield make
    for engine in engines:
        engine.dispose()


# ---------------------------------------------------------------- writers and a known history


@pytest.fixture(params=["thread", "process"])
def make_writer(request: pytest.FixtureRequest) -> Iterator[Callable[..., EventWriter]]:
    """Writer factory with fast retries and no retention, once per kind: the `EventWriter` thread and
    the `WriterProcess` that runs one in a child process. Every writer is closed afterwards."""
    kind = EventWriter if request.param == "thread" else WriterProcess
    writers: list[EventWriter] = []

    def make(url: str, **options) -> EventWriter:
        writer = kind(url, WriterOptions(**{**FAST, **options}))
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.close(timeout_s=10)


@pytest.fixture
def history(db_url: str, make_writer, engine_for) -> tuple[Engine, list[dict], list[str]]:
    """A known eviction log: two runs, ties in time, every reason, unknown ages and hit counts.

    Returns:
        The engine, the expected rows (id, time, run_id, reason, key_hex, request_id, age_s,
        hit_count) in insertion order, and the run ids.
    """
    rng = random.Random(5)
    writer = make_writer(db_url, item_rows=64)
    expected: list[dict] = []
    run_ids = []
    for run_number, count in enumerate((240, 160)):
        run_ids.append(writer.start_run(RunInfo(**{**vars(RUN_INFO), "started_at": BASE_TIME + run_number})))
        events = []
        for i in range(count):
            t = BASE_TIME + run_number * 400 + (i // 3) * 4.9  # three evictions share each time
            row = {
                "id": len(expected) + 1,
                "time": t,
                "run_id": run_ids[-1],
                "reason": rng.choice(REASONS),
                "key_hex": rng.choice(["ab", "abc", "f0", "0f"]) + f"{rng.getrandbits(32):08x}",
                "request_id": f"req-{rng.randrange(12)}",
                "age_s": None if i % 17 == 0 else rng.choice([0.5, 5.0, 59.9, 60.0, 200.0, 1e5]) * rng.random() * 2,
                "hit_count": None if i % 19 == 0 else rng.randrange(150),
            }
            expected.append(row)
            detail = {
                "reason": row["reason"],
                "key": row["key_hex"].upper(),
                "age_s": row["age_s"],
                "hit_count": row["hit_count"],
            }
            events.append(Event(EventKind.EVICT, i, t, row["request_id"], i % 64, 16, detail))
        writer.submit(events)
    assert writer.flush(timeout_s=20)
    return engine_for(db_url), expected, run_ids
