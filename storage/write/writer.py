"""The history writer's database side: a thread that batches, writes, retries, counts and prunes.

The console, the CLI and the fleet collector run it in a process of its own, behind a `WriterProcess`
(storage.write.writer_process); tests and tools may run it in-process. Both keep one contract, the
`HistoryWriter` protocol (storage.write.writer_types: calls that never wait on the database, atomic
items, read-your-writes, exact counts), and one ledger of what was handed over (storage.write.handover:
the numbering, the `queue_items` bound, the counts). What only this thread does:

    * It gathers a batch for up to `batch_interval_s` after its first item (or until `batch_rows`), so a
      request updated on every step is upserted once per batch, its latest view winning. `flush` and
      `wait` cut the wait short (`hurry`).
    * Nothing is lost silently. A batch that fails with a transient error (locked, busy, full, read-only,
      unreachable) is retried with exponential backoff for up to `retry_for_s`; meanwhile new rows wait in
      the queue. A batch given up (or failing with bad data) is counted (`failed_batches`, `dropped`) and
      the error kept in `last_error`. A lock or an outage shorter than `retry_for_s` loses nothing as
      long as the bound holds what arrives meanwhile.
    * A database whose schema is newer than this code (`storage.migrate.SchemaTooNewError`) is not
      retried: the writer gives up at once, keeps the error in `last_error` (not retrying) and drops
      every row handed to it from then on, counted in `dropped`. It never writes to that database.
    * Eviction rollups are updated in the transaction that inserts their evictions; every transaction
      carries the runs not yet committed (storage.write.pending_runs).
    * With a `progress_key` (in a writer process), every transaction also saves the writer's running
      totals (storage.write.progress), and the counters start from the totals saved under that key: the
      `written_*` counts are then those of every writer that ran under the key.

Only the writer thread touches the database; it also applies the retention policy every
`prune_interval_s` seconds and refreshes the current run's heartbeat (storage.write.run_liveness). A
batch's rows go in through storage.write.batch and storage.write.bulk (on SQLite one statement per table
over a JSON array, so the writer holds the GIL for little work per row). Engines sharing one PostgreSQL
database each run their own writer: every writer only adds rows of its own runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.events import Event
from engine.core.snapshot import RequestView
from storage import migrate
from storage.db import db_engine
from storage.schema import RunEnd
from storage.write import progress, run_liveness
from storage.write.batch import Item, is_transient, write_batch
from storage.write.handover import Handed, Ledger
from storage.write.pending_runs import PendingRuns
from storage.write.retention import prune
from storage.write.rows import EncodedEvents, checked_events, checked_views, encode_events
from storage.write.writer_types import HistoryWriter, RowWriter, RunInfo, WriterOptions, WriterStats, new_run_id

__all__ = ["EventWriter", "HistoryWriter", "RowWriter", "RunInfo", "WriterOptions", "WriterStats", "new_run_id"]  # for callers


@dataclass
class _Counters:
    """The counters behind `WriterStats` (the same fields, documented there; `dropped` here only what the
    thread dropped, the ledger counts what was refused), guarded by the writer's lock."""

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
    written_other: int = 0


class EventWriter:
    """The one writer of the history database. See the module docstring for its contract."""

    def __init__(self, url: str, options: WriterOptions | None = None, progress_key: str | None = None) -> None:
        """Start the writer thread for `url` (any SQLAlchemy URL; see `storage.db.default_db_url`).

        The thread first upgrades the schema (retrying while the database is unavailable); nothing
        here touches the database, so a bad or unreachable database shows up in `stats()`.

        Args:
            progress_key: save the running totals under this key in every transaction, and start from
                the totals saved under it (storage.write.progress; a WriterProcess passes its id).
        """
        self._options = options or WriterOptions()
        self._progress_key = progress_key
        self._engine = db_engine(url, busy_timeout_ms=self._options.busy_timeout_ms)
        self._queue: queue.Queue[Item] = queue.Queue()  # unbounded: the ledger bounds what is in flight
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._ledger = Ledger(self._progress, self._options.queue_items)
        self._counters = _Counters()
        self._runs = PendingRuns()
        self._hurry_seq = 0  # a waiter waits for this item: batches stop waiting for more until it is done
        self._closing = threading.Event()
        self._close_deadline = float("inf")  # monotonic time after which failing batches are no longer retried
        self._thread = threading.Thread(target=self._run, name="storage-writer", daemon=True)
        self._thread.start()

    # ---- engine side: never blocks on the database -------------------------------------------

    def start_run(self, info: RunInfo, run_id: str | None = None) -> str:
        """Record a new engine start (stopping the previous run of this writer) and return its id
        (`run_id`, else a new one from `new_run_id`)."""
        run_id = run_id or new_run_id(info.started_at)
        with self._lock:
            self._runs.start(run_id, info)
        self._enqueue(lambda seq: Item(seq))
        return run_id

    def restore_runs(self, runs: Mapping[str, tuple[RunInfo, float | None]]) -> None:
        """Record runs that an earlier writer may not have committed: run id -> (info, stopped_at or None).

        Each run row is inserted unless it is there, each stop time written again; the last run is the
        current one. A WriterProcess's replacement child starts with this.
        """
        with self._lock:
            self._runs.restore(runs)
        self._enqueue(lambda seq: Item(seq))

    def submit(self, events: Sequence[Event]) -> None:
        """Queue events of the current run; EVICT events also become eviction-log rows, the disk tier's events
        tier_moves rows.

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.core.events.Event` (nothing is queued).
        """
        run_id = self._require_run()
        checked_events(events)
        size = self._options.item_rows
        for start in range(0, len(events), size):
            encoded = encode_events(events[start : start + size])
            self._enqueue(lambda seq, part=encoded: Item(seq, run_id, events=part), encoded.count)

    def submit_encoded(self, events: EncodedEvents) -> None:
        """Queue events of the current run that `encode_events` encoded (a writer process receives them
        so), as one atomic item.

        Raises:
            RuntimeError: no run was started.
        """
        run_id = self._require_run()
        if events.count:
            self._enqueue(lambda seq: Item(seq, run_id, events=events), events.count)

    def record_requests(self, views: Iterable[RequestView]) -> None:
        """Queue request views of the current run (upserted by (run_id, request_id), the latest wins).

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.core.snapshot.RequestView` (nothing is queued).
            ValueError: a view lacks a required field (see `storage.write.rows.checked_views`; nothing is queued).
        """
        run_id = self._require_run()
        views = checked_views(views)
        if views:
            self._enqueue(lambda seq: Item(seq, run_id, requests=views), len(views))

    def submit_rows(self, rows: Any, num_rows: int, write: RowWriter, *, wait: bool = False) -> bool:
        """Queue another producer's rows as one atomic item, written by `write(connection, [rows, ...])`.

        Items of one `write` function that share a batch are handed to it together, in submission order,
        inside the batch's transaction (it may raise; the batch is then retried like any other). No run
        is needed.

        Args:
            rows: the row set, opaque to the writer.
            num_rows: how many rows it holds (counted as written or dropped).
            write: the producer's bulk function.
            wait: while the queue is full, wait for room (until the writer closes) instead of dropping.

        Returns:
            False if the rows were dropped (and counted): no room and `wait` was False, or the writer was
            closing.
        """
        return self._enqueue(lambda seq: Item(seq, rows=rows, write_rows=write, num_other=num_rows), num_rows, wait)

    def stats(self) -> WriterStats:
        with self._lock:
            ledger = self._ledger
            counts = {**vars(self._counters), "dropped": self._counters.dropped + ledger.refused}
            return WriterStats(**counts, queued=ledger.queued, lag_s=ledger.lag_s(), done_mark=ledger.done_through())

    def mark(self) -> int:
        """A mark for every row handed over so far (see `wait`)."""
        with self._lock:
            return self._ledger.mark()

    def wait(self, mark: int, timeout_s: float | None = None) -> bool:
        """Write the rows up to `mark` without waiting for more (`hurry`), and wait until they are written
        or dropped.

        Returns:
            False if `timeout_s` passed first. Check `stats()` for what was dropped.
        """
        self.hurry(mark)
        with self._progress:
            return self._progress.wait_for(
                lambda: self._ledger.done_through() >= mark or not self._thread.is_alive(), timeout_s
            )

    def hurry(self, mark: int) -> None:
        """Write the rows up to `mark` without waiting for more to join their batch."""
        with self._progress:
            if self._ledger.done_through() >= mark:
                return
            self._hurry_seq = max(self._hurry_seq, mark)
        self._enqueue(lambda seq: Item(seq))  # wakes a batch that is waiting for more items

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call was written or dropped (`wait(mark())`)."""
        return self.wait(self.mark(), timeout_s)

    def wait_for_progress(self, done_mark: int, timeout_s: float) -> None:
        """Return once an item after `done_mark` is done (written or dropped), or after `timeout_s`."""
        with self._progress:
            self._progress.wait_for(lambda: self._ledger.done_through() > done_mark, timeout_s)

    def close(self, timeout_s: float | None = 30.0, *, interrupted: bool = False) -> bool:
        """Mark the current run stopped, write what is queued, stop the thread, release the engine.

        With `interrupted` (a writer process whose owner died) the run ends as interrupted instead, and its
        requests still waiting or running are closed so (storage.write.run_liveness).

        A batch failing while closing is retried until `timeout_s` has passed (at most `retry_for_s`);
        then it and the rest of the queue are dropped (and counted) rather than retried batch by batch.
        Calls after close are dropped and counted. Calling close again waits again (the first deadline stays).

        Returns:
            False if the thread was still working after `timeout_s` (it is a daemon thread; it stops
            within one more attempt).
        """
        with self._lock:
            if not self._closing.is_set():
                self._runs.stop_current(time.time(), RunEnd.INTERRUPTED if interrupted else RunEnd.STOPPED)
                self._close_deadline = time.monotonic() + (float("inf") if timeout_s is None else timeout_s)
            self._ledger.close()
        self._closing.set()
        self._enqueue(lambda seq: Item(seq))
        self._thread.join(timeout_s)
        finished = not self._thread.is_alive()
        if finished:
            self._engine.dispose()
        return finished

    def _require_run(self) -> str:
        run_id = self._runs.current
        if run_id is None:
            raise RuntimeError("start_run() before submitting rows")
        return run_id

    def _enqueue(self, make_item, num_rows: int = 0, wait: bool = False) -> bool:
        """Hand over the item `make_item(seq)` makes (storage.write.handover). False if it was refused (no
        room and not `wait`, or closed): its rows are counted as dropped."""

        def deliver(seq: int) -> Handed:
            self._queue.put_nowait(make_item(seq))
            return Handed(seq, num_rows, time.monotonic())

        with self._lock:
            return self._ledger.hand_over(deliver, num_rows, wait)

    # ---- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._prepare_schema():
                self._loop()
        finally:
            with self._lock:
                self._ledger.end()  # nothing more is taken: what is queued now is the last
            self._drop_queued()

    def _loop(self) -> None:
        """Batch, write, prune and beat until closed (or a batch given up while closing)."""
        next_prune = time.monotonic()
        next_beat = time.monotonic() + run_liveness.HEARTBEAT_S
        while True:
            items = self._next_batch()
            if items or self._has_pending_runs():
                if not self._write(items) and self._closing.is_set():
                    return
            if time.monotonic() >= next_prune:
                self._prune()
                next_prune = time.monotonic() + self._options.prune_interval_s
            if time.monotonic() >= next_beat:
                self._beat()
                next_beat = time.monotonic() + run_liveness.HEARTBEAT_S
            if self._closing.is_set() and self._queue.empty() and not self._has_pending_runs():
                return

    def _prepare_schema(self) -> bool:
        """Upgrade the schema, retrying while the database is unavailable. False when the writer must stop:
        it is closing, or the schema is newer than this code (then it gives up)."""
        backoff = self._options.first_backoff_s
        while True:
            try:
                migrate.upgrade(self._engine)
                if self._progress_key is not None:
                    with self._engine.connect() as connection:
                        written = progress.load(connection, self._progress_key)
            except migrate.SchemaTooNewError as error:
                self._note_failure(error, retrying=False)
                return False
            except Exception as error:  # the thread must outlive any failure; report it instead
                self._note_failure(error, retrying=not self._closing.is_set())
                if self._closing.is_set():
                    return False
                time.sleep(backoff)
                backoff = min(backoff * 2, self._options.max_backoff_s)
            else:
                with self._lock:
                    if self._progress_key is not None:
                        self._counters.written_events += written.events
                        self._counters.written_requests += written.requests
                        self._counters.written_other += written.other
                    self._counters.schema_ready = True
                    self._counters.retrying = False
                return True

    def _next_batch(self) -> list[Item]:
        """Items for one transaction: what arrives within `batch_interval_s` of the first, up to
        `batch_rows` rows; only what is queued already while a waiter or close is waiting."""
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
            return self._closing.is_set() or self._hurry_seq > self._ledger.done_through()

    def _write(self, items: list[Item]) -> bool:
        """Write one batch, retrying transient failures for up to `retry_for_s`. Returns False if it was
        given up."""
        with self._lock:
            runs, stops = dict(self._runs.rows), dict(self._runs.stops)
            written = progress.Written(
                self._counters.written_events + sum(item.num_events for item in items),
                self._counters.written_requests + sum(item.num_requests for item in items),
                self._counters.written_other + sum(item.num_other for item in items),
            )
        backoff = self._options.first_backoff_s
        give_up_at = None
        while True:
            try:
                with self._engine.begin() as connection:
                    write_batch(connection, items, runs, stops)
                    if self._progress_key is not None and items:
                        progress.save(connection, self._progress_key, written)
            except Exception as error:  # the thread must outlive any failure; report it instead
                give_up_at = give_up_at or time.monotonic() + self._options.retry_for_s
                retry = is_transient(error) and time.monotonic() + backoff < min(give_up_at, self._close_deadline)
                self._note_failure(error, retrying=retry)
                if not retry:
                    self._finish(items, runs, stops, written=False)
                    return False
                time.sleep(backoff)
                backoff = min(backoff * 2, self._options.max_backoff_s)
            else:
                self._finish(items, runs, stops, written=True)
                return True

    def _finish(self, items: list[Item], runs: dict, stops: dict, written: bool) -> None:
        num_events = sum(item.num_events for item in items)
        num_requests = sum(item.num_requests for item in items)
        num_other = sum(item.num_other for item in items)
        with self._progress:
            counters = self._counters
            counters.retrying = False
            if written:
                counters.written_events += num_events
                counters.written_requests += num_requests
                counters.written_other += num_other
                counters.written_batches += 1
                self._runs.committed(runs, stops)
            elif num_events + num_requests + num_other:
                counters.dropped += num_events + num_requests + num_other
                counters.failed_batches += 1
            if items:
                self._mark_done(items[-1].seq)

    def _drop_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            with self._progress:
                self._counters.dropped += item.num_rows
                self._mark_done(item.seq)

    def _mark_done(self, seq: int) -> None:
        """Every item up to `seq` is written or dropped (the lock held)."""
        self._ledger.done_through_seq(seq)

    def _prune(self) -> None:
        try:
            results = prune(self._engine, self._options.retention, time.time())
        except Exception as error:  # retention can wait for the next interval; report it
            self._note_failure(error, retrying=False)
            return
        with self._lock:
            self._counters.pruned_rows += sum(result.rows_deleted for result in results)

    def _beat(self) -> None:
        """Refresh the current run's heartbeat (storage.write.run_liveness); a failure waits for the next one."""
        with self._lock:
            run_id = None if self._closing.is_set() else self._runs.current
        if run_id is None:
            return
        try:
            with self._engine.begin() as connection:
                run_liveness.beat(connection, run_id, time.time())
        except Exception as error:  # the next beat tries again; report it
            self._note_failure(error, retrying=False)

    def _has_pending_runs(self) -> bool:
        with self._lock:
            return bool(self._runs)

    def _note_failure(self, error: Exception, retrying: bool) -> None:
        with self._lock:
            self._counters.last_error = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            self._counters.retrying = retrying
            if retrying:
                self._counters.retries += 1

