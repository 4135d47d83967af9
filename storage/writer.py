"""The single writer: the engine hands it events and request records, a background thread stores them.

Contract with the engine thread:
    * `start_run`, `submit`, `record_requests` and `close` never wait on the database, and do no
      conversion work: events and request records are queued as given (events are immutable; request
      records must not change after the call, as the engine's RequestView snapshots never do). The
      queue is a bounded `queue.Queue`; when it is full the newest data is dropped and counted in
      `stats().dropped`.
    * The writer thread gathers a batch for up to `batch_interval_s` after its first item (or until
      `batch_rows`), so a request updated on every step is converted and upserted once per batch,
      its latest record winning. `flush` and `close` cut the wait short.
    * One `submit()` call of at most `WriterOptions.item_rows` events is written in one transaction,
      together with the `evictions` rows of its EVICT events: a crash loses whole calls, never part
      of one. Longer calls are split into items of that size, each atomic.
    * Nothing is lost silently. A batch that fails is retried with exponential backoff, at most
      `max_attempts` times; a batch given up is counted (`failed_batches`, `dropped`) and the error kept
      in `last_error`. The engine keeps serving throughout; the writer recovers when the database does.
    * Eviction rollups are updated in the transaction that inserts their evictions.
    * A run row is never dropped: it stays pending, and goes into every write transaction until one
      commits, so the rows of that run always find their run.

Only the writer thread touches the database; it also applies the retention policy every
`prune_interval_s` seconds. The engine thread needs the GIL for its own Python work, so the writer
keeps its GIL-held work per row small: on SQLite, every table's rows of a batch go in as one JSON array,
unpacked by SQLite inside one statement (the sqlite3 module releases the GIL while a statement runs; see
`_insert_events_as_json`); on other databases rows go through COPY (psycopg) or executemany, with SQL
compiled by SQLAlchemy (see `_bulk_insert`). Engines sharing one PostgreSQL
database each run their own writer: every writer only adds rows of its own runs.
"""

from __future__ import annotations

import functools
import operator
import queue
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Connection, Table, insert, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, OperationalError

from engine.events import Event, EventKind
from engine.snapshot import RequestView
from storage import migrate, rollups
from storage.db import DEFAULT_BUSY_TIMEOUT_MS, db_engine, encode_json
from storage.models import EventRecord, Eviction, RequestRecord, Run
from storage.retention import RetentionPolicy, prune
from storage.rows import (
    EVENT_COLUMNS,
    EVICTION_COLUMNS,
    REQUEST_DEFAULTS,
    VIEW_COLUMNS,
    checked_request_records,
    event_values,
    eviction_values,
    request_id_of,
    request_row,
    view_values,
)

EVENTS = EventRecord.__table__
EVICTIONS = Eviction.__table__
REQUESTS = RequestRecord.__table__
RUNS = Run.__table__
REQUEST_KEY = ("run_id", "request_id")
# (run_id, time, reason, age_s, hit_count) of an eviction row, as rollups.eviction_deltas takes them.
_ROLLUP_FIELDS = operator.itemgetter(
    *(EVICTION_COLUMNS.index(name) for name in ("run_id", "time", "reason", "age_s", "hit_count"))
)


@dataclass(frozen=True)
class RunInfo:
    """What identifies one engine start."""

    model: str  # preset name or model directory
    num_blocks: int  # KV pool size
    block_size: int  # token slots per block
    dtype: str
    device: str
    weights_revision: str | None = None  # hash or revision of the loaded weights
    namespace: str | None = None  # prefix-cache namespace (hex)
    started_at: float = field(default_factory=time.time)  # epoch seconds


@dataclass(frozen=True)
class WriterOptions:
    """How the writer buffers, batches, retries and prunes."""

    queue_items: int = 2048  # queue bound, in items (one item = one submit chunk or one request call)
    item_rows: int = 512  # most events per item; a submit() of at most this many is atomic
    batch_rows: int = 5000  # rows gathered into one transaction (whole items; may exceed by one item)
    batch_interval_s: float = 0.5  # a batch waits this long after its first item for more (flush cuts it)
    max_attempts: int = 5  # tries per batch before it is given up and counted as dropped
    first_backoff_s: float = 0.05  # wait after the first failure; doubles per failure
    max_backoff_s: float = 2.0  # cap on that wait
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS  # per statement wait for another writer's lock
    prune_interval_s: float = 60.0  # retention runs this often (and once right after start)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    poll_s: float = 0.2  # idle wake-up period of the writer thread


@dataclass(frozen=True)
class WriterStats:
    """A snapshot of the writer's counters (rows are events or request records)."""

    queued: int  # rows waiting in the queue
    written_events: int
    written_requests: int
    written_batches: int  # committed transactions
    dropped: int  # rows that will never be written: queue full, batch given up, writer closed
    failed_batches: int  # batches with rows given up after retries (their rows are in `dropped`)
    retries: int  # failed attempts that were tried again
    retrying: bool  # the thread is waiting to try a failed write (or schema upgrade) again
    last_error: str | None  # the most recent database error, kept after recovery
    schema_ready: bool  # migrations applied; nothing is written before
    pruned_rows: int  # rows deleted by retention


class EncodedEvents(NamedTuple):
    """Events already in the form the writer stores them (`encode_events`), for `submit_encoded`."""

    json: str  # a JSON array with one array per event, the Event fields in order (kind as its value)
    count: int  # events in it
    evictions: tuple[Event, ...]  # its EVICT events, for the eviction log and its rollups


def encode_events(events: Sequence[Event]) -> EncodedEvents:
    """Encode events as the writer stores them (one orjson call, in C); only EVICT events stay objects.

    A WriterProcess sends events this way: its child neither rebuilds nor re-encodes the others.
    """
    evictions = tuple(event for event in events if event.kind is EventKind.EVICT)
    return EncodedEvents(_event_array(events), len(events), evictions)


def _event_array(events: Sequence[Event]) -> str:
    """One JSON array of the events' fields, in order (the kind as its value)."""
    return encode_json(list(map(tuple, events)))


def join_encoded(parts: Sequence[EncodedEvents]) -> EncodedEvents:
    """Several `encode_events` results as one, in order (one JSON array, no re-encoding)."""
    if len(parts) == 1:
        return parts[0]
    evictions = tuple(event for part in parts for event in part.evictions)
    return EncodedEvents(_join_arrays([part.json for part in parts]), sum(part.count for part in parts), evictions)


def _join_arrays(arrays: Sequence[str]) -> str:
    """Non-empty JSON arrays as one array of all their elements."""
    return arrays[0] if len(arrays) == 1 else "[" + ",".join(array[1:-1] for array in arrays) + "]"


@dataclass(frozen=True)
class _Item:
    """One unit of the queue, written whole or not at all. An empty item only wakes the thread."""

    seq: int  # order of submission; `flush` waits on it
    run_id: str | None = None  # the run its rows belong to
    events: tuple[Event, ...] | EncodedEvents = ()
    requests: tuple[Mapping[str, Any] | object, ...] = ()  # request records, converted by the writer thread

    @property
    def num_events(self) -> int:
        return self.events.count if isinstance(self.events, EncodedEvents) else len(self.events)

    @property
    def num_rows(self) -> int:
        return self.num_events + len(self.requests)


@dataclass
class _Counters:
    queued: int = 0
    written_events: int = 0
    written_requests: int = 0
    written_batches: int = 0
    dropped: int = 0
    failed_batches: int = 0
    retries: int = 0
    retrying: bool = False
    last_error: str | None = None
    schema_ready: bool = False
    pruned_rows: int = 0


def new_run_id(started_at: float) -> str:
    """A readable, sortable, unique-enough run id: UTC start time plus 24 random bits."""
    stamp = datetime.fromtimestamp(started_at, tz=UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{secrets.token_hex(3)}"


class EventWriter:
    """The one writer of the history database. See the module docstring for its contract."""

    def __init__(self, url: str | None = None, options: WriterOptions | None = None) -> None:
        """Start the writer thread for `url` (default: `storage.db.default_db_url()`).

        The thread first upgrades the schema (retrying while the database is unavailable); nothing
        here touches the database, so a bad or unreachable database shows up in `stats()`.
        """
        self._options = options or WriterOptions()
        self._engine = db_engine(url, busy_timeout_ms=self._options.busy_timeout_ms)
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=self._options.queue_items)
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._counters = _Counters()
        self._pending_runs: dict[str, dict[str, Any]] = {}  # run rows not yet committed
        self._pending_stops: dict[str, float] = {}  # run id -> stopped_at, not yet committed
        self._current_run: str | None = None
        self._last_seq = 0  # the newest item put into the queue
        self._done_seq = 0  # the newest item written or dropped by the thread
        self._hurry_seq = 0  # a flush waits for this item: batches stop waiting for more until it is done
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="storage-writer", daemon=True)
        self._thread.start()

    # ---- engine side: never blocks on the database -------------------------------------------

    def start_run(self, info: RunInfo, run_id: str | None = None) -> str:
        """Record a new engine start (stopping the previous run of this writer) and return its id
        (`run_id`, else a new one from `new_run_id`)."""
        run_id = run_id or new_run_id(info.started_at)
        row = {"id": run_id, "stopped_at": None, **asdict(info)}
        with self._lock:
            if self._current_run is not None:
                self._pending_stops[self._current_run] = info.started_at
            self._pending_runs[run_id] = row
            self._current_run = run_id
        self._enqueue(lambda seq: _Item(seq))
        return run_id

    def submit(self, events: Sequence[Event]) -> None:
        """Queue events of the current run; EVICT events also become eviction-log rows.

        Raises:
            RuntimeError: no run was started.
        """
        run_id = self._require_run()
        size = self._options.item_rows
        for start in range(0, len(events), size):
            chunk = tuple(events[start : start + size])
            self._enqueue(lambda seq, chunk=chunk: _Item(seq, run_id, events=chunk), len(chunk))

    def submit_encoded(self, events: EncodedEvents) -> None:
        """Queue events of the current run that `encode_events` encoded, as one atomic item.

        Raises:
            RuntimeError: no run was started.
        """
        run_id = self._require_run()
        if events.count:
            self._enqueue(lambda seq: _Item(seq, run_id, events=events), events.count)

    def record_requests(self, requests: Iterable[Mapping[str, Any] | object]) -> None:
        """Queue request records of the current run (upserted by (run_id, request_id), last wins).

        Each is a mapping (copied here) or an object with `engine.request.Request`'s field names (see
        storage.rows) that nobody changes afterwards: the writer thread converts it later, and only
        the latest record of a request in a batch.

        Raises:
            RuntimeError: no run was started.
            ValueError: a record lacks request_id, status or arrival_time (nothing is queued).
        """
        run_id = self._require_run()
        records = tuple(checked_request_records(requests))
        if records:
            self._enqueue(lambda seq: _Item(seq, run_id, requests=records), len(records))

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(**vars(self._counters))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call was written or dropped.

        Returns:
            False if `timeout_s` passed first. Check `stats()` for what was dropped.
        """
        with self._progress:
            target = self._last_seq
            self._hurry_seq = max(self._hurry_seq, target)
        self._enqueue(lambda seq: _Item(seq))  # wakes a batch that is waiting for more items
        with self._progress:
            return self._progress.wait_for(lambda: self._done_seq >= target or not self._thread.is_alive(), timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Mark the current run stopped, write what is queued, stop the thread, release the engine.

        If the database fails while closing, the rest of the queue is dropped (and counted) rather
        than retried batch by batch. Calls after close are dropped and counted.

        Returns:
            False if the thread was still working after `timeout_s` (it is a daemon thread).
        """
        with self._lock:
            if self._current_run is not None:
                self._pending_stops[self._current_run] = time.time()
        self._closing.set()
        self._enqueue(lambda seq: _Item(seq))
        self._thread.join(timeout_s)
        finished = not self._thread.is_alive()
        if finished:
            self._drop_queued()  # anything that raced in behind the thread's last look
            self._engine.dispose()
        return finished

    def _require_run(self) -> str:
        run_id = self._current_run
        if run_id is None:
            raise RuntimeError("start_run() before submitting rows")
        return run_id

    def _enqueue(self, make_item, num_rows: int = 0) -> None:
        with self._lock:
            if self._closing.is_set() and num_rows and not self._thread.is_alive():
                self._counters.dropped += num_rows
                return
            item = make_item(self._last_seq + 1)
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self._counters.dropped += num_rows
                return
            self._last_seq = item.seq
            self._counters.queued += num_rows

    # ---- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        if not self._prepare_schema():
            self._drop_queued()
            return
        next_prune = time.monotonic()
        while True:
            items = self._next_batch()
            if items or self._has_pending_runs():
                if not self._write(items) and self._closing.is_set():
                    self._drop_queued()
                    return
            if time.monotonic() >= next_prune:
                self._prune()
                next_prune = time.monotonic() + self._options.prune_interval_s
            if self._closing.is_set() and self._queue.empty() and not self._has_pending_runs():
                return

    def _prepare_schema(self) -> bool:
        backoff = self._options.first_backoff_s
        while True:
            try:
                migrate.upgrade(self._engine)
            except Exception as error:  # the thread must outlive any failure; report it instead
                self._note_failure(error, retrying=not self._closing.is_set())
                if self._closing.is_set():
                    return False
                time.sleep(backoff)
                backoff = min(backoff * 2, self._options.max_backoff_s)
            else:
                with self._lock:
                    self._counters.schema_ready = True
                    self._counters.retrying = False
                return True

    def _next_batch(self) -> list[_Item]:
        """Items for one transaction: what arrives within `batch_interval_s` of the first, up to
        `batch_rows` rows; only what is queued already while a flush or close is waiting."""
        try:
            first = self._queue.get(timeout=self._options.poll_s)
        except queue.Empty:
            return []
        items = [first]
        num_rows = first.num_rows
        deadline = time.monotonic() + self._options.batch_interval_s
        while num_rows < self._options.batch_rows:
            wait_s = 0.0 if self._in_a_hurry() else deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            items.append(item)
            num_rows += item.num_rows
        return items

    def _in_a_hurry(self) -> bool:
        with self._lock:
            return self._closing.is_set() or self._hurry_seq > self._done_seq

    def _write(self, items: list[_Item]) -> bool:
        """Write one batch with bounded retries. Returns False if it was given up."""
        with self._lock:
            runs = dict(self._pending_runs)
            stops = dict(self._pending_stops)
        backoff = self._options.first_backoff_s
        for attempt in range(1, self._options.max_attempts + 1):
            try:
                with self._engine.begin() as connection:
                    _insert_runs(connection, runs)
                    _insert_items(connection, items)
                    _stop_runs(connection, stops)
            except Exception as error:  # the thread must outlive any failure; report it instead
                retry = _is_transient(error) and attempt < self._options.max_attempts
                self._note_failure(error, retrying=retry)
                if not retry:
                    self._finish(items, runs, stops, written=False)
                    return False
                time.sleep(backoff)
                backoff = min(backoff * 2, self._options.max_backoff_s)
            else:
                self._finish(items, runs, stops, written=True)
                return True
        raise AssertionError("unreachable: the last attempt returns")

    def _finish(self, items: list[_Item], runs: dict, stops: dict, written: bool) -> None:
        num_events = sum(item.num_events for item in items)
        num_requests = sum(len(item.requests) for item in items)
        with self._progress:
            counters = self._counters
            counters.queued -= num_events + num_requests
            counters.retrying = False
            if written:
                counters.written_events += num_events
                counters.written_requests += num_requests
                counters.written_batches += 1
                for run_id in runs:
                    self._pending_runs.pop(run_id, None)
                for run_id, stopped_at in stops.items():
                    if self._pending_stops.get(run_id) == stopped_at:
                        del self._pending_stops[run_id]
            elif num_events + num_requests:
                counters.dropped += num_events + num_requests
                counters.failed_batches += 1
            if items:
                self._done_seq = items[-1].seq
            self._progress.notify_all()

    def _drop_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            with self._progress:
                self._counters.queued -= item.num_rows
                self._counters.dropped += item.num_rows
                self._done_seq = item.seq
                self._progress.notify_all()

    def _prune(self) -> None:
        try:
            results = prune(self._engine, self._options.retention, time.time())
        except Exception as error:  # retention can wait for the next interval; report it
            self._note_failure(error, retrying=False)
            return
        with self._lock:
            self._counters.pruned_rows += sum(result.rows_deleted for result in results)

    def _has_pending_runs(self) -> bool:
        with self._lock:
            return bool(self._pending_runs or self._pending_stops)

    def _note_failure(self, error: Exception, retrying: bool) -> None:
        with self._lock:
            self._counters.last_error = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            self._counters.retrying = retrying
            if retrying:
                self._counters.retries += 1


def _is_transient(error: Exception) -> bool:
    """Locked, busy, read-only, unreachable: worth another try. Bad data is not."""
    if isinstance(error, OperationalError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


def _insert_runs(connection: Connection, runs: dict[str, dict[str, Any]]) -> None:
    """Insert the pending runs that are not in the table yet (a commit may have been lost)."""
    if not runs:
        return
    present = set(connection.scalars(select(RUNS.c.id).where(RUNS.c.id.in_(list(runs)))))
    missing = [row for run_id, row in runs.items() if run_id not in present]
    if missing:
        connection.execute(insert(RUNS), missing)


def _insert_items(connection: Connection, items: list[_Item]) -> None:
    parts_by_run: dict[str, list[tuple[Event, ...] | EncodedEvents]] = {}  # each run's events, in item order
    for item in items:
        if item.num_events:
            parts_by_run.setdefault(item.run_id, []).append(item.events)  # type: ignore[arg-type]
    for run_id, parts in parts_by_run.items():
        if connection.dialect.name == "sqlite":
            _insert_events_as_json(connection, run_id, [_events_json(part) for part in parts])
        else:
            rows = [event_values(run_id, event) for part in parts for event in _events_of(part)]
            _bulk_insert(connection, EVENTS, EVENT_COLUMNS, rows)
        evictions = [eviction_values(run_id, event) for part in parts for event in _evictions_of(part)]
        if evictions:
            _bulk_insert(connection, EVICTIONS, EVICTION_COLUMNS, evictions)
            rollups.add_evictions(connection, rollups.eviction_deltas(map(_ROLLUP_FIELDS, evictions)))
    latest = {(item.run_id, request_id_of(record)): (item.run_id, record) for item in items for record in item.requests}
    views_by_run: dict[str, list[RequestView]] = {}
    others = []
    for run_id, record in latest.values():
        if connection.dialect.name == "sqlite" and isinstance(record, RequestView):
            views_by_run.setdefault(run_id, []).append(record)
        else:
            others.append(request_row(run_id, record))
    for run_id, views in views_by_run.items():
        _upsert_views_as_json(connection, run_id, views)
    if others:
        _upsert_requests(connection, others)


def _events_json(part: tuple[Event, ...] | EncodedEvents) -> str:
    return part.json if isinstance(part, EncodedEvents) else _event_array(part)


def _events_of(part: tuple[Event, ...] | EncodedEvents) -> Sequence[Event]:
    """The events of a part (decoded ones carry their kind as its value, which `event_values` takes)."""
    return [Event._make(fields) for fields in orjson.loads(part.json)] if isinstance(part, EncodedEvents) else part


def _evictions_of(part: tuple[Event, ...] | EncodedEvents) -> Iterable[Event]:
    if isinstance(part, EncodedEvents):
        return part.evictions
    return (event for event in part if event.kind is EventKind.EVICT)


def _insert_events_as_json(connection: Connection, run_id: str, arrays: list[str]) -> None:
    """SQLite: the `events` rows of one run in one statement that reads them from one JSON array.

    The arrays (one per item, see `encode_events`) are built in C by orjson, as `event_values` would
    encode each value, and joined here; SQLite unpacks them inside a single statement step, during
    which the sqlite3 module releases the GIL. Row by row (executemany) the writer held the GIL for
    every row's conversion and binding, and the engine thread, whose Python work needs the GIL too,
    took about three times as long for the steps that overlapped a batch.
    """
    # Every column after run_id is the Event field of the same name.
    elements = [_json_element(Event._fields.index(name)) for name in EVENT_COLUMNS[1:]]
    statement = _insert_from_json(connection, EVENTS, EVENT_COLUMNS, ["?", *elements])
    connection.exec_driver_sql(statement, (run_id, _join_arrays(arrays)))


def _insert_rows_as_json(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple]) -> None:
    """SQLite: driver-ready row tuples in one statement over a JSON array (see `_insert_events_as_json`)."""
    statement = _insert_from_json(connection, table, columns, [_json_element(i) for i in range(len(columns))])
    connection.exec_driver_sql(statement, (encode_json(rows),))


def _upsert_views_as_json(connection: Connection, run_id: str, views: list[RequestView]) -> None:
    """SQLite: upsert the `requests` rows of one run's engine views in one statement over a JSON array
    (built in C from `view_values`), for the same reason as `_insert_events_as_json`."""
    quote = connection.dialect.identifier_preparer.quote
    elements = []
    for index, column in enumerate(VIEW_COLUMNS):
        if column in REQUEST_DEFAULTS:  # request_row's default, as a JSON literal
            default = encode_json(REQUEST_DEFAULTS[column])
            elements.append(f"coalesce({_json_element(index)}, json_extract('{default}', '$'))")
        else:
            elements.append(_json_element(index))
    updates = ", ".join(f"{quote(c)} = excluded.{quote(c)}" for c in VIEW_COLUMNS if c not in REQUEST_KEY)
    statement = (
        _insert_from_json(connection, REQUESTS, ("run_id", *VIEW_COLUMNS), ["?", *elements])
        + f" WHERE true ON CONFLICT (run_id, request_id) DO UPDATE SET {updates}"
    )
    connection.exec_driver_sql(statement, (run_id, encode_json(list(map(view_values, views)))))


def _insert_from_json(connection: Connection, table: Table, columns: Sequence[str], values: Sequence[str]) -> str:
    """INSERT INTO table (columns) SELECT values FROM json_each(?): one row per element of the JSON array
    bound last; `values` are SQL expressions over that element (`value`), or `?` for a bound value."""
    quote = connection.dialect.identifier_preparer.quote
    return (
        f"INSERT INTO {quote(table.name)} ({', '.join(map(quote, columns))}) "
        f"SELECT {', '.join(values)} FROM json_each(?)"
    )


def _json_element(index: int) -> str:
    return f"json_extract(value, '$[{index}]')"


def _bulk_insert(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """INSERT `rows` (driver-ready values in `columns` order, see storage.rows).

    SQLite: one statement over a JSON array (`_insert_rows_as_json`); psycopg: COPY; any other driver:
    executemany of the statement SQLAlchemy compiles from `insert(table)`. SQLAlchemy's per-row parameter
    processing is skipped everywhere, because it cost more than SQLite's own insert.
    """
    if connection.dialect.driver == "psycopg":
        _copy_rows(connection, table, columns, rows)
        return
    if connection.dialect.name == "sqlite":
        _insert_rows_as_json(connection, table, columns, rows)
        return
    compiled = insert(table).inline().compile(dialect=connection.dialect, column_keys=list(columns))
    if not compiled.positional:
        parameters: list[Any] = [dict(zip(columns, row, strict=True)) for row in rows]
    elif tuple(compiled.positiontup) == tuple(columns):
        parameters = rows
    else:
        order = [columns.index(name) for name in compiled.positiontup]
        parameters = [tuple(row[index] for index in order) for row in rows]
    connection.exec_driver_sql(compiled.string, parameters)


def _copy_rows(connection: Connection, table: Table, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    """PostgreSQL through psycopg: COPY FROM STDIN in the current transaction (about twice the rows/s
    of executemany here). The statement is composed by psycopg from quoted identifiers."""
    from psycopg import sql  # the PostgreSQL driver; SQLite users need not install it

    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table.name), sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    driver_connection = connection.connection.driver_connection
    try:
        with driver_connection.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)
    except connection.dialect.loaded_dbapi.Error as error:
        # As SQLAlchemy would have wrapped it, so failures are classified like every other statement's.
        text = statement.as_string(driver_connection)
        raise DBAPIError.instance(text, None, error, connection.dialect.loaded_dbapi.Error) from error


def _upsert_requests(connection: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert or replace request rows by (run_id, request_id); rows have distinct keys."""
    dialect = connection.dialect.name
    if dialect in ("sqlite", "postgresql"):
        connection.execute(_upsert_statement(dialect, tuple(rows[0])), rows)
        return
    keys = [tuple(row[name] for name in REQUEST_KEY) for row in rows]
    key_columns = tuple_(*(REQUESTS.c[name] for name in REQUEST_KEY))
    connection.execute(REQUESTS.delete().where(key_columns.in_(keys)))
    connection.execute(insert(REQUESTS), rows)


@functools.cache
def _upsert_statement(dialect: str, columns: tuple[str, ...]):
    """INSERT ... ON CONFLICT (run_id, request_id) DO UPDATE for SQLite or PostgreSQL, built once
    (building it costs more than a batch of request rows)."""
    statement = (sqlite.insert if dialect == "sqlite" else postgresql.insert)(REQUESTS)
    updates = {name: statement.excluded[name] for name in columns if name not in REQUEST_KEY}
    return statement.on_conflict_do_update(index_elements=REQUEST_KEY, set_=updates)


def _stop_runs(connection: Connection, stops: dict[str, float]) -> None:
    for run_id, stopped_at in stops.items():
        connection.execute(update(RUNS).where(RUNS.c.id == run_id).values(stopped_at=stopped_at))
