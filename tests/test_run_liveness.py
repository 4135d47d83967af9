"""Runs whose owner died: a later start closes them and their open requests as interrupted; live runs stay
open (issue 47 item 7; storage.write.run_liveness has the rule). Each test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from sqlalchemy import insert, select

from storage import migrate
from storage.read import queries
from engine.core.request import RequestStatus
from storage.schema import INTERRUPTED_STATUS, OPEN_STATUSES, REQUESTS, RUNS, RunEnd
from storage.write import run_liveness
from storage.write.writer import RunInfo
from tests.storage_support import BASE_TIME, REPO, RUN_INFO, request_view, wait_for

# A server that starts a run through a real WriterProcess, records three requests (running, waiting,
# finished), waits until they are committed, prints "ready" and then serves forever.
SERVER = """
import sys, time
from storage.write.writer import RunInfo
from storage.write.writer_process import WriterProcess
from tests.storage_support import FAST, request_view
from storage.write.writer_types import WriterOptions

writer = WriterProcess(sys.argv[1], WriterOptions(**FAST))
run_id = writer.start_run(RunInfo(model="m", num_blocks=8, block_size=16, dtype="float32", device="cpu"))
writer.record_requests([request_view("req-0", status="running"), request_view("req-1", status="waiting"),
                        request_view("req-2", status="finished")])
if not writer.flush(timeout_s=60):
    sys.exit("not written")
print(run_id, writer.pid, "ready", flush=True)
while True:
    time.sleep(1)
"""


def statuses(engine, run_id: str) -> dict[str, str]:
    with engine.connect() as connection:
        rows = connection.execute(select(REQUESTS.c.request_id, REQUESTS.c.status).where(REQUESTS.c.run_id == run_id))
        return dict(rows.all())


def run_row(engine, run_id: str):
    with engine.connect() as connection:
        return connection.execute(select(RUNS).where(RUNS.c.id == run_id)).one()


def test_a_run_killed_with_its_writer_is_closed_as_interrupted_at_the_next_start(
    db_url: str, make_writer, engine_for
) -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, db_url],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,  # its own process group: the server and its writer process die together
    )
    try:
        dead_run, _, ready = server.stdout.readline().split()
        assert ready == "ready"
        live = make_writer(db_url)  # a console of this process, running while the other dies
        live_run = live.start_run(RUN_INFO)
        assert live.flush(timeout_s=20)
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # kill -9 of the server and its writer at once
        server.wait(timeout=30)
    engine = engine_for(db_url)
    assert run_row(engine, dead_run).stopped_at is None  # nobody closed it: it looks as if still running
    assert statuses(engine, dead_run) == {"req-0": "running", "req-1": "waiting", "req-2": "finished"}

    restarted = make_writer(db_url)
    new_run = restarted.start_run(RunInfo(**{**vars(RUN_INFO), "started_at": time.time()}))
    assert restarted.flush(timeout_s=20)

    dead = run_row(engine, dead_run)
    assert dead.end_reason == RunEnd.INTERRUPTED and dead.stopped_at is not None
    assert dead.stopped_at <= time.time() and dead.pid == server.pid
    assert statuses(engine, dead_run) == {"req-0": "interrupted", "req-1": "interrupted", "req-2": "finished"}
    for run_id in (live_run, new_run):  # their owner (this process) lives: left open
        assert run_row(engine, run_id).stopped_at is None and run_row(engine, run_id).end_reason is None
    listed = queries.runs(engine).set_index("id")
    assert listed.loc[dead_run, "end_reason"] == "interrupted"


def test_a_writer_process_whose_server_died_ends_its_run_interrupted(db_url: str, engine_for) -> None:
    """Only the server is killed: its writer process writes what it got and closes the run and its open
    requests as interrupted on its way out."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, db_url], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        run_id = server.stdout.readline().split()[0]
    finally:
        server.kill()
        server.wait(timeout=30)
    engine = engine_for(db_url)
    assert wait_for(lambda: run_row(engine, run_id).end_reason is not None, timeout_s=60)
    assert run_row(engine, run_id).end_reason == RunEnd.INTERRUPTED
    assert statuses(engine, run_id) == {"req-0": "interrupted", "req-1": "interrupted", "req-2": "finished"}


def test_a_run_of_another_host_is_closed_only_once_its_heartbeat_is_stale(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine)
    now = time.time()
    base = {**vars(RUN_INFO), "stopped_at": None, "end_reason": None}
    stale = now - run_liveness.STALE_AFTER_S - 1
    rows = [
        {**base, "id": "fresh-elsewhere", "host": "another-host", "pid": 1, "heartbeat_at": now - 60},
        {**base, "id": "stale-elsewhere", "host": "another-host", "pid": 1, "heartbeat_at": stale},
        {**base, "id": "older-revision", "host": None, "pid": None, "heartbeat_at": None, "started_at": BASE_TIME},
        {**base, "id": "mine", "heartbeat_at": now},  # this process: alive
        {**base, "id": "stopped", "host": "another-host", "heartbeat_at": BASE_TIME, "stopped_at": BASE_TIME + 5,
         "end_reason": RunEnd.STOPPED.value},
    ]  # fmt: skip
    with engine.begin() as connection:
        connection.execute(insert(RUNS), rows)
        connection.execute(insert(REQUESTS), [
            {"run_id": "stale-elsewhere", "request_id": "a", "status": "running", "prompt_tokens": 3,
             "output_token_ids": [], "cached_tokens": 0, "computed_tokens": 0, "hit_source": "none", "cow_copies": 0,
             "preemptions": 0, "arrival_time": BASE_TIME},
        ])  # fmt: skip
        closed = run_liveness.close_interrupted_runs(connection, now)
    assert sorted(closed) == ["older-revision", "stale-elsewhere"]
    assert run_row(engine, "stale-elsewhere").stopped_at == stale  # its last sign of life
    assert run_row(engine, "older-revision").stopped_at == BASE_TIME  # no heartbeat: its start
    assert statuses(engine, "stale-elsewhere") == {"a": "interrupted"}
    assert run_row(engine, "stopped").end_reason == RunEnd.STOPPED and run_row(engine, "fresh-elsewhere").stopped_at is None
    with engine.begin() as connection:  # closing again changes nothing
        assert run_liveness.close_interrupted_runs(connection, now) == []


def test_a_heartbeat_reopens_a_run_closed_while_its_writer_was_cut_off(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine)
    row = {**vars(RUN_INFO), "id": "r", "stopped_at": None, "end_reason": None, "heartbeat_at": BASE_TIME}
    with engine.begin() as connection:
        connection.execute(insert(RUNS), [row])
        assert run_liveness.close_interrupted_runs(connection, time.time()) == ["r"]
        run_liveness.beat(connection, "r", time.time())
    reopened = run_row(engine, "r")
    assert reopened.stopped_at is None and reopened.end_reason is None and reopened.heartbeat_at > BASE_TIME


def test_a_dead_pid_of_this_host_is_interrupted_and_a_live_one_is_not() -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)  # exited and reaped
    now = time.time()
    host = run_liveness.this_host()
    assert run_liveness.is_interrupted(host, dead_pid, now, now) or run_liveness.pid_alive(dead_pid)  # reused: alive
    assert not run_liveness.is_interrupted(host, os.getpid(), now, now)
    assert not run_liveness.is_interrupted("another-host", dead_pid, now, now)  # its pid means nothing here
    assert run_liveness.is_interrupted(host, os.getpid(), now - run_liveness.STALE_AFTER_S - 1, now)


def test_a_clean_close_ends_the_run_stopped(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    run_id = writer.start_run(RUN_INFO)
    writer.record_requests([request_view("a", status="running")])
    assert writer.close(timeout_s=20)
    engine = engine_for(db_url)
    assert run_row(engine, run_id).end_reason == RunEnd.STOPPED
    assert statuses(engine, run_id) == {"a": "running"}  # a clean close leaves records as the engine left them


def test_the_statuses_an_interruption_closes_are_the_engines_unfinished_ones() -> None:
    assert OPEN_STATUSES == (RequestStatus.WAITING, RequestStatus.RUNNING)
    assert INTERRUPTED_STATUS not in {status.value for status in RequestStatus}  # the engine never gives it
