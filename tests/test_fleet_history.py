"""The fleet history on real databases: what a collector sees, persisted through the history writer.

Held blocks follow the fleet index's copy counting (a property test drives both with the same random
feed), the eviction log knows each removal's age and ends each lifetime, clears and restarts end what
was held, several collectors share one database, retention never prunes a watched pod's blocks, and
vLLM's own KVCacheManager, published by vLLM's ZmqEventPublisher, ends up in the database exactly as its
block pool holds it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, inspect, select

from fleet.collector import Collector
from fleet.config import CollectorConfig
from fleet.events import AllBlocksCleared, PodMetrics, PodReset, ResetReason
from fleet.index import FleetIndex
from storage.read import fleet_queries
from storage import migrate
from storage.write.fleet_bulk import write_fleet_rows
from storage.write.fleet_rows import FleetRowBuilder, hash_text, parse_hash_text
from storage.write.fleet_sink import FleetStore
from storage.schema import FLEET_METRICS, FLEET_SOURCES, PRUNES, RUNS, Base
from storage.write.retention import RetentionPolicy, prune
from storage.write.writer import EventWriter, WriterOptions
from tests.fleet_history_support import (
    batch,
    event_rows,
    evictions,
    held_copies,
    held_rows,
    pod_source,
    removed,
    stored,
)
from tests.storage_support import FAST, LATEST_REVISION, count_rows, wait_for

U64_MAX = 2**64 - 1


@pytest.fixture
def fleet_writer(db_url: str):
    writer = EventWriter(db_url, WriterOptions(**FAST))
    yield writer
    writer.close(timeout_s=10)


def opened_store(writer: EventWriter, *pods: str, at: float = 50.0) -> FleetStore:
    store = FleetStore(writer)
    for pod in pods:
        store.open_pod(pod_source(pod), at)
    return store


# ---------------------------------------------------------------- the migration


def test_revision_0006_adds_the_fleet_tables_to_a_database_at_0003(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine, "0003")
    row = {"id": "old", "model": "m", "num_blocks": 4, "block_size": 16, "dtype": "float32", "device": "cpu"}
    with engine.begin() as connection:
        connection.execute(insert(RUNS), [{**row, "started_at": 1.0}])
        assert "fleet_blocks" not in inspect(connection).get_table_names()

    migrate.upgrade(engine)

    assert migrate.current_revision(engine) == LATEST_REVISION
    assert count_rows(engine, RUNS) == 1
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        names = set(inspect(connection).get_table_names())
    assert {"fleet_sources", "fleet_events", "fleet_blocks", "fleet_evictions"} <= names


# ---------------------------------------------------------------- lifetimes, evictions, events


def test_a_lifetime_opens_with_the_first_copy_and_ends_with_the_last(db_url: str, fleet_writer, engine_for) -> None:
    store = opened_store(fleet_writer, "a")
    store.apply_batch(batch("a", 0, stored([1, 2, U64_MAX]), ts=10.0))
    store.apply_batch(batch("a", 1, stored([1]), removed(2), ts=12.0))  # a second copy of 1; 2 goes
    store.apply_batch(batch("a", 2, removed(1), removed(9), ts=13.0))  # one copy of 1 left; 9 was never held
    store.apply_batch(batch("a", 3, removed(1), ts=16.0))
    assert fleet_writer.flush(20)
    engine, source = engine_for(db_url), store.source_ids()["a"]

    assert held_rows(engine, source) == [(2, str(U64_MAX), 1, 10.0)]
    assert evictions(engine, source) == [
        (12.0, "removed", "2", 2.0, 0),  # its lifetime: 2 s
        (13.0, "removed", "1", 3.0, 1),  # one of two copies
        (13.0, "removed", "9", None, None),  # an eviction whose age nobody knows
        (16.0, "removed", "1", 6.0, 0),  # the last copy: a lifetime of 6 s
    ]
    assert held_copies(engine, source) == {("GPU", 0, U64_MAX): 1}
    assert fleet_writer.stats().dropped == 0


def test_consecutive_removals_of_one_batch_share_an_event_row(db_url: str, fleet_writer, engine_for) -> None:
    store = opened_store(fleet_writer, "a")
    store.apply_batch(batch("a", 0, stored([1, 2, 3]), stored([7], group=1)))
    store.apply_batch(batch("a", 1, removed(1), removed(2), removed(7, group=1), removed(3), stored([4]), removed(4)))
    assert fleet_writer.flush(20)

    rows = event_rows(engine_for(db_url), store.source_ids()["a"])
    assert rows == [
        (0, "stored", 3, ["1", "2", "3"]),
        (0, "stored", 1, ["7"]),
        (1, "removed", 2, ["1", "2"]),
        (1, "removed", 1, ["7"]),  # another group: a row of its own
        (1, "removed", 1, ["3"]),
        (1, "stored", 1, ["4"]),
        (1, "removed", 1, ["4"]),
    ]


def test_a_clear_and_a_restart_end_every_open_lifetime(db_url: str, fleet_writer, engine_for) -> None:
    store = opened_store(fleet_writer, "a")
    store.apply_batch(batch("a", 0, stored([1, 2]), ts=10.0))
    # 3 opens and ends in the batch of the clear; 4 opens after it and stays.
    store.apply_batch(batch("a", 1, stored([3]), AllBlocksCleared(), stored([4]), ts=11.0))
    assert fleet_writer.flush(20)
    store.apply_batch(batch("a", 2, stored([5]), ts=12.0))
    store.reset_pod(PodReset("a", ResetReason.RESTARTED, 13.0, 2, 0))
    store.apply_batch(batch("a", 0, stored([6]), ts=14.0))
    assert fleet_writer.flush(20)
    engine, source = engine_for(db_url), store.source_ids()["a"]

    assert evictions(engine, source) == [
        (11.0, "cleared", "1", 1.0, 0),
        (11.0, "cleared", "2", 1.0, 0),
        (11.0, "cleared", "3", 0.0, 0),  # stored in the batch of the clear, before it
        (13.0, "reset", "4", 2.0, 0),
        (13.0, "reset", "5", 1.0, 0),
    ]
    assert held_rows(engine, source) == [(5, "6", 1, 14.0)]
    assert [kind for _, kind, _, _ in event_rows(engine, source)] == [
        "stored", "stored", "cleared", "stored", "stored", "reset", "stored",
    ]  # fmt: skip


def test_hashes_are_stored_as_text_that_reads_back_exactly() -> None:
    for block_hash in (0, 1, U64_MAX, -(2**63), b"\x00\xff" * 16):
        assert parse_hash_text(hash_text(block_hash)) == block_hash
    assert hash_text(U64_MAX) == "18446744073709551615"  # vLLM's unsigned ints, as they are published
    assert hash_text(b"\xab\x01") == "0xab01"


# ---------------------------------------------------------------- the rule is the index's


HASHES = st.integers(0, 5)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(HASHES, min_size=1, max_size=3), st.integers(0, 1)),
        st.tuples(st.just("remove"), st.lists(HASHES, min_size=1, max_size=3), st.integers(0, 1)),
        st.tuples(st.just("clear")),
        st.tuples(st.just("reset")),
        st.tuples(st.just("commit")),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_stored_blocks_always_equal_the_fleet_index(db_url: str, engine_for, ops) -> None:
    """Any feed, cut into transactions anywhere: the held rows and their copies are what the index
    holds, and every lifetime opened is either held or ended by exactly one eviction row. The examples
    share one database (each its own collector id), migrated on the first."""
    db = engine_for(db_url)
    migrate.upgrade(db)
    builder = FleetRowBuilder(f"property-{time.monotonic_ns()}")
    index = FleetIndex()
    source = pod_source("a")
    pending = [builder.open(source, 1.0)]
    index.open_pod(source, 1.0)
    seq = 0

    def feed(*events) -> None:
        nonlocal seq
        pod_batch = batch("a", seq, *events, ts=10.0 + seq)
        seq += 1
        pending.append(builder.batch(pod_batch))
        index.apply_batch(pod_batch)

    def commit() -> None:
        with db.begin() as connection:
            write_fleet_rows(connection, pending)
        pending.clear()

    for op in ops:
        if op[0] == "store":
            feed(stored(op[1], group=op[2]))
        elif op[0] == "remove":
            feed(removed(*op[1], group=op[2]))
        elif op[0] == "clear":
            feed(AllBlocksCleared())
        elif op[0] == "reset":
            reset = PodReset("a", ResetReason.RESTARTED, 10.0 + seq, seq - 1, 0)
            pending.append(builder.reset(reset))
            index.reset_pod(reset)
        else:
            commit()
    commit()

    source_id = builder.source_ids()["a"]
    assert held_copies(db, source_id) == index.copies("a")
    held = held_rows(db, source_id)
    ended = [row for row in evictions(db, source_id) if row[4] == 0]
    assert len(held) + len(ended) == builder.num_lifetimes("a")
    assert all(copies >= 1 for _, _, copies, _ in held)


def test_a_unit_brings_its_source_when_its_opening_was_lost_and_never_rewrites_it(db_url: str, engine_for) -> None:
    """Every unit carries its source row: inserted when missing (the unit that opened the pod was lost),
    left as it is when present (a later unit must not undo the source's closing time)."""
    db = engine_for(db_url)
    migrate.upgrade(db)
    builder = FleetRowBuilder(f"lost-open-{time.monotonic_ns()}")
    builder.open(pod_source("a"), 1.0)  # never written
    with db.begin() as connection:
        write_fleet_rows(connection, [builder.batch(batch("a", 0, stored([7]), ts=10.0))])
        write_fleet_rows(connection, [builder.close(20.0)])
    with db.begin() as connection:
        write_fleet_rows(connection, [builder.batch(batch("a", 1, removed(7), ts=30.0))])
    source_id = builder.source_ids()["a"]
    with db.connect() as connection:
        times = select(FLEET_SOURCES.c.opened_at, FLEET_SOURCES.c.closed_at).where(FLEET_SOURCES.c.id == source_id)
        rows = [tuple(row) for row in connection.execute(times)]
    assert rows == [(1.0, 20.0)]
    assert held_rows(db, source_id) == []
    assert evictions(db, source_id) == [(30.0, "removed", "7", 20.0, 0)]


# ---------------------------------------------------------------- the writer hook


def test_a_producer_that_may_wait_waits_for_room_instead_of_dropping(tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()
    written: list[str] = []

    def slow_write(connection, row_sets) -> None:
        started.set()
        release.wait(20)
        written.extend(row_sets)

    options = WriterOptions(**{**FAST, "queue_items": 2, "batch_rows": 1})
    writer = EventWriter(f"sqlite:///{tmp_path / 'h.sqlite'}", options)
    try:
        assert writer.submit_rows("first", 1, slow_write)
        assert started.wait(20)  # the thread is writing it: in flight until it is written
        assert writer.submit_rows("second", 1, slow_write)  # fills the bound
        assert not writer.submit_rows("dropped", 1, slow_write)  # no room, no waiting: counted
        waited = threading.Thread(target=writer.submit_rows, args=("third", 1, slow_write), kwargs={"wait": True})
        waited.start()
        time.sleep(0.2)
        assert waited.is_alive(), "the waiting producer returned while the queue was full"
        release.set()
        waited.join(10)
        assert writer.flush(10)
        stats = writer.stats()
    finally:
        release.set()
        writer.close(timeout_s=10)
    assert written == ["first", "second", "third"]
    assert (stats.written_other, stats.dropped) == (3, 1)


def test_rows_a_producer_cannot_write_are_counted_as_dropped(tmp_path: Path) -> None:
    def broken(connection, row_sets) -> None:
        raise ValueError("bad rows")

    writer = EventWriter(f"sqlite:///{tmp_path / 'h.sqlite'}", WriterOptions(**FAST))
    try:
        writer.submit_rows(object(), 7, broken)
        assert writer.flush(10)
        stats = writer.stats()
    finally:
        writer.close(timeout_s=10)
    assert (stats.dropped, stats.failed_batches, stats.written_other) == (7, 1, 0)
    assert "bad rows" in stats.last_error


# ---------------------------------------------------------------- several collectors, one database


def test_two_writers_starting_together_in_one_process_both_get_their_schema(tmp_path: Path) -> None:
    """Regression: Alembic's context is process-global; two writer threads migrating at once left one
    failing with KeyError 'config' and the other waiting on a lock, forever."""
    writers = [EventWriter(f"sqlite:///{tmp_path / 'h.sqlite'}", WriterOptions(**FAST)) for _ in range(3)]
    try:
        assert wait_for(lambda: all(writer.stats().schema_ready for writer in writers), timeout_s=20)
    finally:
        for writer in writers:
            writer.close(timeout_s=10)


def test_collectors_sharing_a_database_write_their_own_rows_and_read_all(db_url: str, engine_for) -> None:
    writers = [EventWriter(db_url, WriterOptions(**FAST)) for _ in range(2)]
    try:
        first, second = opened_store(writers[0], "a", "b"), opened_store(writers[1], "b", at=60.0)
        first.apply_batch(batch("a", 0, stored([1, 2])))
        first.apply_batch(batch("b", 0, stored([3])))
        second.apply_batch(batch("b", 0, stored([3, 4, 5]), ts=200.0))
        for writer in writers:
            assert writer.flush(20)
    finally:
        for writer in writers:
            writer.close(timeout_s=10)
    engine = engine_for(db_url)

    assert first.collector_id != second.collector_id
    assert count_rows(engine, FLEET_SOURCES) == 3
    latest = fleet_queries.latest_sources(engine)
    assert latest["pod"].tolist() == ["a", "b"]
    assert latest["collector_id"].tolist() == [first.collector_id, second.collector_id]  # b: the newer watch
    summary = fleet_queries.held_summary(engine, latest["id"].tolist())
    assert {row.source_id: (row.hashes, row.blocks) for row in summary.itertuples()} == {
        first.source_ids()["a"]: (2, 2),
        second.source_ids()["b"]: (3, 3),
    }
    assert latest["last_ts"].tolist() == [100.0, 200.0]


# ---------------------------------------------------------------- queries


def test_rates_evictions_and_lifetimes_read_back(db_url: str, fleet_writer, engine_for) -> None:
    store = opened_store(fleet_writer, "a")
    store.apply_batch(batch("a", 0, stored([1, 2, 3, 4]), ts=1000.0))
    store.apply_batch(batch("a", 1, removed(1), removed(2), ts=1005.0))
    store.apply_batch(batch("a", 2, stored([5]), removed(3), ts=1030.0))
    store.apply_batch(batch("a", 3, removed(3), ts=1031.0))  # not held any more: unknown age
    store.apply_batch(batch("a", 4, AllBlocksCleared(), ts=4000.0))
    store.close(5000.0)
    assert fleet_writer.flush(20)
    engine, source = engine_for(db_url), store.source_ids()["a"]

    rates = fleet_queries.block_rates(engine, [source], since=0.0, bucket_seconds=10.0)
    assert rates[["bucket_start", "kind", "blocks"]].values.tolist() == [
        [1000.0, "removed", 2], [1000.0, "stored", 4], [1030.0, "removed", 2], [1030.0, "stored", 1],
    ]  # fmt: skip
    log = fleet_queries.eviction_log(engine, [source], limit=3)
    assert log[["block_hash", "reason"]].values.tolist() == [["5", "cleared"], ["4", "cleared"], ["3", "removed"]]
    assert log["age_s"].isna().tolist() == [False, False, True]
    ages = fleet_queries.eviction_age_histogram(engine, [source])
    assert ages["evictions"].tolist() == [0, 2, 1, 0, 0, 0, 0, 0, 0, 1]  # 5 s, 5 s in [1, 10); 30 s; one unknown
    ended = fleet_queries.lifetime_histogram(engine, [source])
    by_reason = ended.groupby("reason")["lifetimes"].sum().to_dict()
    assert by_reason == {"cleared": 2, "removed": 3}
    assert fleet_queries.latest_sources(engine)["closed_at"].tolist() == [5000.0]


# ---------------------------------------------------------------- retention


def test_retention_prunes_old_fleet_history_but_never_a_watched_pods_blocks(db_url: str, engine_for) -> None:
    writer = EventWriter(db_url, WriterOptions(**FAST))
    try:
        watching = opened_store(writer, "a")
        watching.apply_batch(batch("a", 0, stored(range(10)), ts=1_000.0))  # held all along
        watching.apply_batch(batch("a", 1, *(removed(h) for h in range(1, 10)), ts=1_001.0))
        watching.apply_batch(batch("a", 2, stored(range(20, 26)), ts=100_000.0))
        gone = opened_store(writer, "b", at=900.0)
        gone.apply_batch(batch("b", 0, stored([7, 8]), ts=1_000.0))
        gone.close(at=1_002.0)  # its collector stopped on day one
        assert writer.flush(20)
    finally:
        writer.close(timeout_s=10)
    engine = engine_for(db_url)

    one_day = RetentionPolicy(max_age_days=1.0, chunk_rows=3)
    results = {(r.table_name, r.reason): r.rows_deleted for r in prune(engine, one_day, now=100_000.0 + 3600)}

    assert results[("fleet_evictions", "age")] == 9 and results[("fleet_events", "age")] == 3
    assert results[("fleet_blocks", "age")] == 2  # b's, closed on day one
    assert held_copies(engine, watching.source_ids()["a"]) == {("GPU", 0, h): 1 for h in (0, 20, 21, 22, 23, 24, 25)}
    assert held_copies(engine, gone.source_ids()["b"]) == {}
    assert count_rows(engine, FLEET_SOURCES) == 2
    with engine.connect() as connection:
        logged = {tuple(row) for row in connection.execute(select(PRUNES.c.table_name, PRUNES.c.reason))}
    assert ("fleet_blocks", "age") in logged


def scrape(pod: str, at: float) -> PodMetrics:
    return PodMetrics(pod, at, 100.0, 40.0, 0.0, 0.5, 1.0, 0.0, num_gpu_blocks=128)


def test_retention_bounds_fleet_metrics_by_count_and_by_age_keeping_the_newest(db_url: str, engine_for) -> None:
    old = {"a": [1_000.0, 1_005.0, 1_010.0], "b": [1_000.0, 1_005.0]}  # day one
    new = {"a": [100_000.0, 100_005.0, 100_010.0, 100_015.0], "b": [100_000.0, 100_005.0, 100_010.0]}
    writer = EventWriter(db_url, WriterOptions(**FAST))
    try:
        store = opened_store(writer, "a", "b")
        for scrapes in (old, new):
            for pod, times in scrapes.items():
                for at in times:
                    store.apply_metrics(scrape(pod, at))
        assert writer.flush(20)
    finally:
        writer.close(timeout_s=10)
    engine = engine_for(db_url)

    policy = RetentionPolicy(max_age_days=1.0, max_fleet_metrics=8, chunk_rows=2)
    results = {(r.table_name, r.reason): r.rows_deleted for r in prune(engine, policy, now=100_000.0 + 3600)}

    # The count keeps the newest 8 of 12 (a's three old scrapes and b's first go); the age takes b's other old one.
    assert results[("fleet_metrics", "max_rows")] == 4 and results[("fleet_metrics", "age")] == 1
    sources = store.source_ids()
    with engine.connect() as connection:
        kept = connection.execute(select(FLEET_METRICS.c.source_id, FLEET_METRICS.c.at)).all()
        logged = {tuple(row) for row in connection.execute(select(PRUNES.c.table_name, PRUNES.c.reason))}
    assert sorted(kept) == sorted((sources[pod], at) for pod, times in new.items() for at in times)
    assert {("fleet_metrics", "max_rows"), ("fleet_metrics", "age")} <= logged


# ---------------------------------------------------------------- vLLM's own feed into the database


def test_vllms_block_pool_ends_up_in_the_database_batch_by_batch(db_url: str, engine_for) -> None:
    pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")
    from tests.fleet_support import VllmPod, wait_until

    pod = VllmPod(num_blocks=16, block_size=4)
    writer = EventWriter(db_url, WriterOptions(**FAST))
    store = FleetStore(writer)
    index = FleetIndex()
    engine = engine_for(db_url)
    config = CollectorConfig(replay_idle_timeout_s=1.0, poll_interval_s=0.02)
    try:
        with Collector([pod.source()], [index, store], config) as collector:
            wait_until(lambda: collector.stats()[pod.name].ready, "the start-up replay")
            wait_until(lambda: collector.stats()[pod.name].num_connects == 1, "the SUB socket to connect")
            time.sleep(0.2)  # a PUB socket drops what it sends before the subscription reaches it

            def step(name: str) -> None:
                if pod.publish():
                    wait_until(lambda: index.pod(pod.name).last_seq == pod.num_published - 1, name)
                assert writer.flush(20)
                assert held_copies(engine, store.source_ids()[pod.name]) == pod.cached() == index.copies(pod.name), name

            a = pod.request(list(range(14)))
            pod.allocate(a)
            step("allocate a")
            c, d = pod.request(list(range(200, 209))), pod.request(list(range(200, 209)))
            lookup_c, lookup_d = pod.lookup(c), pod.lookup(d)
            pod.allocate(c, lookup_c)
            pod.allocate(d, lookup_d)
            step("two copies of c's blocks")
            for request in (a, c, d):
                pod.free(request)
            e = pod.request(list(range(1000, 1046)))  # 11 full blocks: evicts cached ones, LRU first
            pod.allocate(e)
            step("evictions for e")
            pod.free(e)
            assert pod.reset()
            step("reset")
        store.close()
        assert writer.flush(20)
    finally:
        writer.close(timeout_s=10)
        pod.close()
    source = store.source_ids()[pod.name]
    assert {reason for _, reason, _, _, _ in evictions(engine, source)} == {"removed", "cleared"}
    assert all(age is not None for _, _, _, age, _ in evictions(engine, source))  # every removal's age known
    assert writer.stats().dropped == 0
