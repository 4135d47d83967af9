"""Storage benchmark: writer throughput and eviction-log query latency.

    .venv/bin/python benchmarks/storage.py [--rows 1000000] [--url URL]

1. Insert throughput through the real `EventWriter` (batched, one transaction per batch) against a
   naive writer that commits one row per transaction (run on fewer rows; its rate is extrapolated).
2. The eviction-log queries on `--rows` eviction rows, against the indexed schema and against a copy
   whose evictions table has no secondary indexes. Each query's time is the median of repeated runs.

Goals: >= 50,000 events/s; every log query < 50 ms on 1M rows. Without --url everything runs on
SQLite files in a temporary directory; with a PostgreSQL URL the database must be empty.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Engine, create_engine, insert, make_url, select, text  # noqa: E402

from engine.events import Event, EventKind, EvictReason  # noqa: E402
from storage import migrate, queries  # noqa: E402
from storage.db import db_engine  # noqa: E402
from storage.models import EventRecord, Eviction, Run  # noqa: E402
from storage.retention import RetentionPolicy  # noqa: E402
from storage.writer import EventWriter, RunInfo, WriterOptions  # noqa: E402

GOAL_EVENTS_PER_S = 50_000
GOAL_QUERY_MS = 50.0
START = 1_750_000_000.0  # evictions are spread over one day from here
SPAN_S = 86_400.0
REASON_WEIGHTS = {EvictReason.LRU: 80, EvictReason.PARENT_EVICTED: 15, EvictReason.WINDOW: 4, EvictReason.RESET: 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="eviction rows for the query benchmark")
    parser.add_argument("--write-events", type=int, default=200_000, help="events through the real writer")
    parser.add_argument("--naive-events", type=int, default=2_000, help="events through the naive writer")
    parser.add_argument("--url", help="database URL (default: SQLite files in a temporary directory)")
    args = parser.parse_args()
    backend = make_url(args.url).get_backend_name() if args.url else "sqlite (temporary files)"
    print(f"backend: {backend}; load average {_load()} ({os.cpu_count()} CPUs)\n")
    with fresh_databases(args.url) as url_for:
        history_url = url_for("history")
        run_ids, fill_rate = fill_evictions(history_url, args.rows)
        print(f"history: {args.rows:,} EVICT events through the writer at {fill_rate:,.0f} events/s")
        print("  (each: an events row, an evictions row with 5 indexes, a rollup update)")
        bench_writes(url_for("write"), history_url, url_for("naive"), args.write_events, args.naive_events)
        bench_queries(history_url, run_ids)
    print(f"\nload average at the end: {_load()}")


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


@contextmanager
def fresh_databases(server_url: str | None) -> Iterator[Callable[[str], str]]:
    """Yield `url_for(name)`: a new empty database per benchmark phase, removed afterwards.

    Without a server URL they are SQLite files in a temporary directory; with one, databases created
    on that server (its user needs CREATEDB).
    """
    if server_url is None:
        with tempfile.TemporaryDirectory() as scratch:
            yield lambda name: f"sqlite:///{Path(scratch) / name}.sqlite"
        return
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    created: list[str] = []

    def url_for(name: str) -> str:
        database = f"storage_bench_{name}_{os.getpid()}"
        with admin.connect() as connection:  # DDL takes no parameters; the name is ours
            connection.execute(text(f'DROP DATABASE IF EXISTS "{database}"'))
            connection.execute(text(f'CREATE DATABASE "{database}"'))
        created.append(database)
        return make_url(server_url).set(database=database).render_as_string(hide_password=False)

    try:
        yield url_for
    finally:
        with admin.connect() as connection:
            for database in created:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


# ---- writes ----------------------------------------------------------------------------------


def make_events(count: int, rng: random.Random) -> list[Event]:
    """A plausible stream: one EVICT in four, the rest block and request events."""
    kinds = [EventKind.ALLOCATE, EventKind.CACHE, EventKind.RELEASE, EventKind.HIT, EventKind.SCHEDULE]
    events = []
    for i in range(count):
        t = START + i * 0.001
        request_id = f"req-{i // 40}"
        if i % 4 == 0:
            detail = {
                "reason": EvictReason.LRU.value,
                "key": f"{rng.getrandbits(64):016x}",
                "start_pos": 0,
                "end_pos": 16,
                "age_s": rng.expovariate(1 / 120),
                "hit_count": rng.randrange(20),
                "last_used": t - 1,
                "group": "full",
            }
            events.append(Event(EventKind.EVICT, i // 32, t, request_id, i % 4096, 16, detail))
        else:
            events.append(Event(kinds[i % len(kinds)], i // 32, t, request_id, i % 4096, 16, {"group": "full"}))
    return events


def bench_writes(empty_url: str, history_url: str, naive_url: str, num_events: int, num_naive: int) -> None:
    events = make_events(num_events, random.Random(0))
    info = RunInfo(model="bench", num_blocks=4096, block_size=16, dtype="float32", device="cpu")
    results = [
        ("EventWriter, empty database", *timed_writer_run(empty_url, events, info)),
        ("EventWriter, into the history", *timed_writer_run(history_url, events, info)),
        ("one transaction per event", *timed_naive_run(naive_url, events[:num_naive], info)),
    ]
    naive_rate = results[-1][1] / results[-1][2]
    print("\ninsert throughput (one EVICT in four; each also writes an eviction row)")
    print(f"  {'writer':30} {'events':>9} {'events/s':>10} {'per CPU-s':>10} {'vs naive':>9}")
    for name, count, seconds, cpu_s in results:
        rate = count / seconds
        print(f"  {name:30} {count:>9,} {rate:>10,.0f} {count / cpu_s:>10,.0f} {rate / naive_rate:>8.1f}x")
    best = max(count / seconds for _, count, seconds, _ in results)
    verdict = "meets" if best >= GOAL_EVENTS_PER_S else "MISSES"
    print(f"  goal >= {GOAL_EVENTS_PER_S:,} events/s (wall clock, on this machine's load): {verdict}")


def timed_writer_run(url: str, events: list[Event], info: RunInfo) -> tuple[int, float, float]:
    """Events written, wall seconds and process CPU seconds for `events` through an EventWriter."""
    retention = RetentionPolicy(max_age_days=None, max_events=None, max_evictions=None)
    writer = EventWriter(url, WriterOptions(queue_items=len(events) // 256 + 16, retention=retention))
    writer.start_run(info)
    writer.flush()
    started, cpu_started = time.perf_counter(), time.process_time()
    for start in range(0, len(events), 256):  # engine-like: one submit per step
        writer.submit(events[start : start + 256])
    writer.flush()
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    stats = writer.stats()
    writer.close()
    if stats.dropped or stats.written_events != len(events):
        raise RuntimeError(f"the writer lost rows: {stats}")
    return stats.written_events, seconds, cpu_s


def timed_naive_run(url: str, events: list[Event], info: RunInfo) -> tuple[int, float, float]:
    """The naive writer: one transaction per event (its eviction row included, no rollups)."""
    engine = db_engine(url)
    migrate.upgrade(engine)
    with engine.begin() as connection:
        connection.execute(insert(Run.__table__), [{"id": "naive", **_run_row(info)}])
    started, cpu_started = time.perf_counter(), time.process_time()
    for event in events:
        with engine.begin() as connection:
            connection.execute(insert(EventRecord.__table__), _naive_row("naive", event))
            if event.kind is EventKind.EVICT:
                connection.execute(insert(Eviction.__table__), _naive_eviction_row("naive", event))
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    engine.dispose()
    return len(events), seconds, cpu_s


def _naive_row(run_id: str, event: Event) -> dict:
    return {
        "run_id": run_id, "step": event.step, "time": event.time, "kind": event.kind.value,
        "request_id": event.request_id, "block_id": event.block_id, "tokens": event.tokens, "detail": event.detail,
    }  # fmt: skip


def _naive_eviction_row(run_id: str, event: Event) -> dict:
    detail = event.detail
    return {
        "run_id": run_id, "time": event.time, "block_id": event.block_id, "key_hex": detail["key"],
        "start_pos": detail["start_pos"], "end_pos": detail["end_pos"], "reason": detail["reason"],
        "age_s": detail["age_s"], "hit_count": detail["hit_count"], "last_used": detail["last_used"],
        "group": detail["group"], "request_id": event.request_id,
    }  # fmt: skip


def _run_row(info: RunInfo) -> dict:
    return {
        "model": info.model, "num_blocks": info.num_blocks, "block_size": info.block_size,
        "dtype": info.dtype, "device": info.device, "started_at": info.started_at,
    }  # fmt: skip


# ---- queries ---------------------------------------------------------------------------------


def eviction_events(first: int, count: int, num_rows: int, rng: random.Random) -> list[Event]:
    """Evictions first..first+count of `num_rows` over one day: weighted reasons, random keys, and
    request ids that grow with time as the engine's do (each request evicts 20 blocks)."""
    reasons = [reason.value for reason in REASON_WEIGHTS]
    weights = list(REASON_WEIGHTS.values())
    events = []
    for i in range(first, first + count):
        t = START + SPAN_S * i / num_rows
        detail = {
            "reason": rng.choices(reasons, weights)[0],
            "key": f"{rng.getrandbits(64):016x}",
            "start_pos": (i % 64) * 16,
            "end_pos": (i % 64) * 16 + 16,
            "age_s": rng.expovariate(1 / 300),
            "hit_count": min(int(rng.expovariate(1 / 3)), 500),
            "last_used": t - rng.random() * 60,
            "group": "full",
        }
        events.append(Event(EventKind.EVICT, i // 32, t, f"req-{i // 20}", i % 4096, 16, detail))
    return events


def fill_evictions(url: str, num_rows: int) -> tuple[list[str], float]:
    """Write `num_rows` EVICT events through the writer, in three consecutive runs.

    Returns:
        The run ids, and the fill rate in events/s (each event also writes an eviction row).
    """
    rng = random.Random(1)
    # Keep a day-old benchmark history: no age pruning, and room for every row.
    retention = RetentionPolicy(max_age_days=None, max_events=None, max_evictions=None)
    writer = EventWriter(url, WriterOptions(retention=retention))
    info = RunInfo(model="bench", num_blocks=4096, block_size=16, dtype="float32", device="cpu", started_at=START)
    run_ids = []
    started = time.perf_counter()
    chunk = 256
    for first in range(0, num_rows, chunk):
        if first * 3 // num_rows == len(run_ids):
            run_ids.append(writer.start_run(info))
        writer.submit(eviction_events(first, min(chunk, num_rows - first), num_rows, rng))
        if first % (chunk * 512) == 0:
            writer.flush()  # bound the queue: this producer is faster than any database
    writer.flush()
    rate = num_rows / (time.perf_counter() - started)
    stats = writer.stats()
    writer.close()
    if stats.dropped or stats.written_events != num_rows:
        raise RuntimeError(f"fill lost rows: {stats}")
    return run_ids, rate


def drop_secondary_indexes(engine: Engine) -> None:
    with engine.begin() as connection:
        for index in Eviction.__table__.indexes:
            index.drop(connection)


def analyze(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("ANALYZE"))


def median_ms(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and process-CPU milliseconds of `run` (CPU: this process, so SQLite's work but not
    a PostgreSQL server's), after one warm-up call."""
    run()  # warm the page cache and the statement cache
    wall, cpu = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        run()
        wall.append((time.perf_counter() - started) * 1000)
        cpu.append((time.process_time() - cpu_started) * 1000)
    return statistics.median(wall), statistics.median(cpu)


def query_cases(
    engine: Engine, num_rows: int, run_ids: list[str], use_rollups: bool
) -> dict[str, Callable[[], object]]:
    """The console's eviction queries; `use_rollups=False` makes the aggregates scan the log."""
    table = Eviction.__table__
    deep_offset = num_rows * 9 // 10
    with engine.connect() as connection:
        deep = connection.execute(
            select(table.c.time, table.c.id)
            .order_by(table.c.time.desc(), table.c.id.desc())
            .offset(deep_offset)
            .limit(1)
        ).one()
        some_key = connection.scalar(select(table.c.key_hex).where(table.c.id == num_rows // 2))
        some_request = connection.scalar(select(table.c.request_id).where(table.c.id == num_rows // 3))
    everything = queries.EvictionFilters()
    last_hour = queries.EvictionFilters(since=START + SPAN_S - 3600.5)
    filtered = queries.EvictionFilters(
        reasons=(EvictReason.PARENT_EVICTED.value,),
        run_id=run_ids[1],
        since=START + SPAN_S * 0.5,
        until=START + SPAN_S * 0.6,
    )
    rollups = {"use_rollups": use_rollups}
    return {
        "log: first page": lambda: queries.eviction_log(engine),
        "log: filtered page (reason+run+time)": lambda: queries.eviction_log(engine, filtered),
        f"log: deep page (keyset, row {deep_offset:,})": lambda: queries.eviction_log(
            engine, after=queries.Cursor(deep.time, deep.id)
        ),
        "log: request filter": lambda: queries.eviction_log(engine, queries.EvictionFilters(request_id=some_request)),
        "log: key prefix (6 hex)": lambda: queries.eviction_log(
            engine, queries.EvictionFilters(key_prefix=some_key[:6])
        ),
        "count (filtered)": lambda: queries.eviction_count(engine, filtered, **rollups),
        "over time, all rows (5 min buckets)": lambda: queries.evictions_over_time(engine, 300, everything, **rollups),
        "age histogram, all rows": lambda: queries.age_at_eviction_histogram(engine, everything, **rollups),
        "hits histogram, all rows": lambda: queries.hits_before_eviction_histogram(engine, everything, **rollups),
        "over time, last hour (1 min)": lambda: queries.evictions_over_time(engine, 60, last_hour, **rollups),
        "age histogram, last hour": lambda: queries.age_at_eviction_histogram(engine, last_hour, **rollups),
        "hits histogram, last hour": lambda: queries.hits_before_eviction_histogram(engine, last_hour, **rollups),
    }


def bench_queries(url: str, run_ids: list[str]) -> None:
    engine = db_engine(url)
    num_rows = queries.eviction_count(engine)
    analyze(engine)
    designed = {name: median_ms(run, 7) for name, run in query_cases(engine, num_rows, run_ids, True).items()}
    scanned = {name: median_ms(run, 3) for name, run in query_cases(engine, num_rows, run_ids, False).items()}
    drop_secondary_indexes(engine)
    analyze(engine)
    unindexed = {name: median_ms(run, 3) for name, run in query_cases(engine, num_rows, run_ids, False).items()}
    engine.dispose()

    print(f"\neviction queries on {num_rows:,} rows, median wall ms (goal < {GOAL_QUERY_MS:.0f} ms)")
    print("  designed = indexes + rollups (cpu: its client CPU ms); log scan = indexes, aggregates scan the log;")
    print("  no index = neither")
    print(f"  {'query':40} {'designed':>9} {'cpu':>6} {'log scan':>9} {'no index':>9} {'vs no index':>12}  goal")
    for name, (ms, cpu_ms) in designed.items():
        verdict = "ok" if ms < GOAL_QUERY_MS else "MISS"
        log_ms, no_index_ms = scanned[name][0], unindexed[name][0]
        ratio = no_index_ms / ms
        print(f"  {name:40} {ms:>9.1f} {cpu_ms:>6.1f} {log_ms:>9.1f} {no_index_ms:>9.1f} {ratio:>11.1f}x  {verdict}")


if __name__ == "__main__":
    main()
