"""The history writer: an `EventWriter` in a process of its own; the caller's process only encodes and sends.

`WriterProcess` keeps the writer's contract (storage.write.writer_types.HistoryWriter) and runs an
`EventWriter` in a child process (storage.write.writer_child), so the database work (the inserts, the
writer's Python and its hold on the GIL) never runs in the engine's interpreter. The console's engine
history, `python -m cli run-trace` and the fleet collector (the console's and `python -m cli fleet watch`)
all write through it.

Data flow, one way:
    caller: check, encode --> outbox --(sender thread)--> multiprocessing connection --> child: EventWriter
    child: its stats and "every message up to N is done" --> connection --> receiver thread --> `stats()`

    * Every call becomes one numbered message (`submit` one per `item_rows` chunk, encoded on the calling
      thread: one orjson call; `record_requests` one, the views without their prompts; `submit_rows`
      one). The call appends it to the outbox and returns; the sender thread pickles and sends it, and
      only the sender ever waits on the pipe. The child queues each message as one item of its
      EventWriter, which is the only batching layer: it gathers items for `batch_interval_s`, coalesces
      request views, writes a batch in one transaction.
    * The bound and the numbering are the ledger's (storage.write.handover): at most `queue_items`
      messages are in flight (in the outbox, the pipe or the child's queue, not yet written or dropped).
      The child's own writer is unbounded: it never holds more.
    * The child reports after every transaction which messages are done, and `wait(mark)` hurries them
      and waits for that report: read-your-writes.
    * Counting, derived: `written_*` are the child's (saved in the database inside every transaction,
      storage.write.progress, so a replacement starts from them), `queued` is the rows of the messages
      in flight, and `dropped` is the rest of what was handed over. So written + queued + dropped ==
      handed over, always, and exactly: the engine's events and request records and the rows handed in
      through `submit_rows` (the fleet's, `written_other`) alike.

Visibility latency (benchmarks/storage.py section 4 measures it, tests/test_under_load.py holds it): a row
is committed within `batch_interval_s` plus the child's transaction times once it is sent. The child
runs at `child_niceness` (default 0, the engine's own priority), so busy processes beside the engine slow
it by their fair share instead of starving it (at nice 19 rows waited up to 17 s behind two busy loops).
The bound: p99 under 2 s and every row under 5 s, with two busy processes on a 2-core machine.

Faults:
    * The child killed or crashed: the receiver thread sees its connection end and starts a new child
      (at once; after the second child in a row that lived under `QUICK_EXIT_S`, with a backoff doubling
      up to `MAX_RESTART_DELAY_S`), which first reads what its predecessors committed: the messages they
      were sent are then done, their uncommitted rows counted as dropped, exactly. The runs are sent
      again; history goes on. `stats().restarts` counts restarts, `last_error` says why.
    * This process dies: the child sees its connection end, writes everything it received and exits.
    * Database faults (locked, full, read-only, unreachable) are the child writer's: retried for up to
      `retry_for_s`, rows waiting in the child's queue meanwhile.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.core.events import Event
from engine.core.snapshot import RequestView
from storage.db import db_engine
from storage.write import progress
from storage.write.handover import Handed, Ledger
from storage.write.rows import checked_events, checked_views, encode_events, view_without_prompt
from storage.write.writer_types import RowWriter, RunInfo, WriterOptions, WriterStats, new_run_id

ROOT = Path(__file__).resolve().parents[2]
QUICK_EXIT_S = 5.0  # a child that exits sooner than this after its start counts as a quick exit
FIRST_RESTART_DELAY_S = 0.5  # the wait before a restart after two quick exits in a row; doubles with each more
MAX_RESTART_DELAY_S = 30.0
NO_STATS = WriterStats(
    queued=0, written_events=0, written_requests=0, written_batches=0, dropped=0, failed_batches=0, retries=0,
    retrying=False, last_error=None, schema_ready=False, pruned_rows=0,
)  # fmt: skip


@dataclass
class _Message(Handed):
    """A call on its way to the child: in the outbox, or sent and not yet reported done."""

    body: tuple = ()  # what the child receives after the number: (kind, *arguments)
    generation: int | None = None  # the child it was sent to (None while in the outbox)


class _Child:
    """One writer process and the two ends of its connections."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.started = time.monotonic()
        self.answered_close = False  # it reported "closed" (and exits)
        child_in, self.outbox = multiprocessing.Pipe(duplex=False)
        self.inbox, child_out = multiprocessing.Pipe(duplex=False)
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "storage.write.writer_child", str(child_in.fileno()), str(child_out.fileno())],
                pass_fds=(child_in.fileno(), child_out.fileno()),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": python_path},
            )
        finally:
            child_in.close()
            child_out.close()

    def send(self, message: tuple) -> bool:
        """Send one message (blocking while the pipe is full). False if the child is gone."""
        try:
            self.outbox.send(message)
        except (OSError, EOFError):
            return False
        return True


class WriterProcess:
    """The history writer, its database work in a child process. See the module docstring."""

    def __init__(self, url: str, options: WriterOptions | None = None) -> None:
        """Start the writer process for `url` (any SQLAlchemy URL; see `storage.db.default_db_url`).

        Raises:
            storage.db.DatabaseUrlError: `url` cannot name a database this process can use, as
                `EventWriter` raises it. An unreachable database is reported in `stats()` instead.
        """
        self.options = options or WriterOptions()
        db_engine(url).dispose()  # a malformed URL or a missing driver fails here, not in the child
        self._url = url
        self._writer_id = secrets.token_hex(8)  # the key of its committed totals (storage.write.progress)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a report arrived, a message went, or the child changed
        self._sending = threading.Lock()  # held while a message goes into the current child's pipe
        self._outbox: deque[_Message] = deque()  # messages not sent yet, in order
        self._ledger = Ledger(self._changed, self.options.queue_items)  # every message not reported done
        self._runs: dict[str, tuple[RunInfo, float | None]] = {}  # every run started: (info, stopped_at)
        self._current_run: str | None = None
        self._child_stats = NO_STATS  # the running child's latest report
        self._written = progress.Written()  # every child's committed rows, once one has read them back
        self._past = NO_STATS  # the counters of the children that exited
        self._last_error: str | None = None
        self._restarts = 0
        self._quick_exits = 0  # children in a row that exited soon after their start
        self._close_timeout_s: float | None = None  # how long the first close() call waits
        self._gone = False  # the child answered close and exited
        with self._sending:
            self._child = self._start_child(0)
        self._listen(self._child)
        threading.Thread(target=self._send_outbox, name="writer-process-sender", daemon=True).start()

    @property
    def pid(self) -> int:
        """The running writer process's id."""
        with self._lock:
            return self._child.process.pid

    # ---- the caller's side: never waits on the database ------------------------------------

    def start_run(self, info: RunInfo) -> str:
        """Record a new engine start (stopping the previous run) and return its id."""
        run_id = new_run_id(info.started_at)
        with self._lock:
            if self._current_run is not None:
                self._runs[self._current_run] = (self._runs[self._current_run][0], info.started_at)
            self._runs[run_id] = (info, None)
            self._current_run = run_id
            self._hand_over(("run", run_id, info), 0)
        return run_id

    def submit(self, events: Sequence[Event]) -> None:
        """Queue events of the current run (see `HistoryWriter`).

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.core.events.Event` (nothing is queued).
        """
        self._require_run()
        checked_events(events)
        size = self.options.item_rows
        for start in range(0, len(events), size):  # each chunk one atomic item, as EventWriter.submit does
            encoded = encode_events(events[start : start + size])
            # Plain tuples: the pickle module handles them in C, NamedTuples and enums in Python.
            logged = list(map(tuple, encoded.evictions)), list(map(tuple, encoded.tier_moves))
            body = ("events", encoded.json, encoded.count, *logged)
            with self._changed:
                self._hand_over(body, encoded.count)

    def record_requests(self, views: Iterable[RequestView]) -> None:
        """Queue request views of the current run (see `HistoryWriter`).

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.core.snapshot.RequestView` (nothing is queued).
            ValueError: a view lacks a required field (nothing is queued).
        """
        self._require_run()
        views = checked_views(views)
        if views:
            with self._changed:
                self._hand_over(("views", list(map(view_without_prompt, views))), len(views))

    def submit_rows(self, rows: Any, num_rows: int, write: RowWriter, *, wait: bool = False) -> bool:
        """Queue another producer's rows as one atomic item (see `HistoryWriter`); `rows` must
        pickle and `write` be a module-level function.

        Args:
            wait: while `queue_items` messages are in flight, wait for room (until close) instead of dropping.

        Returns:
            False if the rows were dropped (and counted).
        """
        with self._changed:
            return self._hand_over(("rows", rows, num_rows, write), num_rows, wait=wait)

    def stats(self) -> WriterStats:
        with self._lock:
            child, past, ledger = self._child_stats, self._past, self._ledger
            written = self._written
            return WriterStats(
                queued=ledger.queued,
                written_events=written.events,
                written_requests=written.requests,
                written_batches=past.written_batches + child.written_batches,
                dropped=ledger.accepted - written.events - written.requests - written.other - ledger.queued,
                failed_batches=past.failed_batches + child.failed_batches,
                retries=past.retries + child.retries,
                retrying=child.retrying,
                last_error=self._last_error,
                schema_ready=child.schema_ready,
                pruned_rows=past.pruned_rows + child.pruned_rows,
                written_other=written.other,
                lag_s=ledger.lag_s(),
                done_mark=ledger.done_through(),
                restarts=self._restarts,
            )

    def mark(self) -> int:
        """A mark for every row (and run) handed over so far: the number of the newest message."""
        with self._lock:
            return self._ledger.mark()

    def wait(self, mark: int, timeout_s: float | None = None) -> bool:
        """Have the child write the rows up to `mark` without waiting for more, and wait until they are
        written or dropped.

        Returns:
            False if `timeout_s` passed first. Check `stats()` for what was dropped.
        """
        with self._changed:
            if self._ledger.done_through() >= mark:
                return True
            if not self._ledger.closed:  # close hurries by itself
                self._hand_over(("hurry",), 0)
            return self._changed.wait_for(lambda: self._ledger.done_through() >= mark or self._gone, timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call was written or dropped (`wait(mark())`)."""
        return self.wait(self.mark(), timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Stop the current run, let the child write what it got, and wait for it to exit.

        Rows handed over after close started are dropped and counted.

        Returns:
            False if the child was still working after `timeout_s` (it finishes on its own).
        """
        with self._changed:
            if not self._ledger.closed:
                self._hand_over(("close", timeout_s), 0)
                self._ledger.close()
                self._close_timeout_s = timeout_s
            return self._changed.wait_for(lambda: self._gone, timeout_s)

    def _require_run(self) -> None:
        if self._current_run is None:
            raise RuntimeError("start_run() before submitting rows")

    def _hand_over(self, body: tuple, num_rows: int, wait: bool = False) -> bool:
        """Number a message and put it in the outbox (the lock held); False if the ledger refused it (its
        rows are then counted as dropped)."""

        def deliver(seq: int) -> _Message:
            message = _Message(seq, num_rows, time.monotonic(), body)
            self._outbox.append(message)
            return message

        return self._ledger.hand_over(deliver, num_rows, wait)

    # ---- the sender thread -------------------------------------------------------------------

    def _send_outbox(self) -> None:
        """Send the outbox's messages in order, each to the child running when it goes (only this thread
        takes from the outbox)."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._outbox or self._gone)
                if self._gone:
                    return
            with self._sending:
                with self._lock:
                    message, child = self._outbox.popleft(), self._child
                    message.generation = child.generation
                try:
                    child.send((message.seq, *message.body))  # to a child that is gone: its successor settles it
                    continue
                except Exception as error:  # what cannot be pickled (a lock, a lambda in a view): counted, shown
                    reason = f"rows could not be sent to the writer process: {type(error).__name__}: {error}"
            with self._changed:
                self._ledger.done(message)
                self._last_error = reason
                self._changed.notify_all()

    # ---- the children ------------------------------------------------------------------------

    def _start_child(self, generation: int) -> _Child:
        """Start a child and tell it the database, and the runs when it replaces one (`_sending` held)."""
        child = _Child(generation)
        child.send((0, "open", self._url, self.options, self._writer_id))
        with self._lock:
            runs = dict(self._runs)
        if runs:
            child.send((0, "runs", runs))
        return child

    def _listen(self, child: _Child) -> None:
        """Start taking `child`'s reports (once it is the running child: the reports of others are ignored)."""
        threading.Thread(target=self._receive, args=(child,), name="writer-process-receiver", daemon=True).start()

    def _receive(self, child: _Child) -> None:
        """The receiver thread of `child`: its reports, until its connection ends; then its exit."""
        while True:
            try:
                kind, stats, done_seq = child.inbox.recv()
            except (EOFError, OSError):
                break
            self._child_reported(child, kind, stats, done_seq)
        child.inbox.close()
        self._child_exited(child, child.process.wait())

    def _child_reported(self, child: _Child, kind: str, stats: WriterStats, done_seq: int) -> None:
        """`child`'s stats, and that every message it got up to `done_seq` is done."""
        with self._changed:
            if child is not self._child:
                return
            if stats.last_error is not None and stats.last_error != self._child_stats.last_error:
                self._last_error = stats.last_error
            self._child_stats = stats
            in_flight = self._ledger.in_flight.values()
            settled = [m for m in in_flight if m.generation == child.generation and m.seq <= done_seq]
            if stats.schema_ready:  # it has read what every child before it committed
                self._written = progress.Written(stats.written_events, stats.written_requests, stats.written_other)
                settled += [m for m in in_flight if m.generation is not None and m.generation < child.generation]
            if kind == "closed":  # it got every message before close: what is still open went to a killed
                child.answered_close = True  # predecessor the database could not tell about: dropped
                settled = list(in_flight)
            for message in settled:
                self._ledger.done(message)
            self._changed.notify_all()

    def _child_exited(self, child: _Child, returncode: int) -> None:
        """`child` exited: done if it answered close, else replace it."""
        with self._sending:
            child.outbox.close()
        with self._changed:
            stats = self._child_stats
            self._past = replace(
                self._past,
                written_batches=self._past.written_batches + stats.written_batches,
                failed_batches=self._past.failed_batches + stats.failed_batches,
                retries=self._past.retries + stats.retries,
                pruned_rows=self._past.pruned_rows + stats.pruned_rows,
            )
            self._child_stats = NO_STATS
            if child.answered_close:
                self._gone = True
                self._changed.notify_all()
                return
            self._last_error = f"the writer process exited (code {returncode}) before close; restarted"
            quick = time.monotonic() - child.started < QUICK_EXIT_S
            self._quick_exits = self._quick_exits + 1 if quick else 0
            delay = 0.0 if self._quick_exits < 2 else FIRST_RESTART_DELAY_S * 2 ** (self._quick_exits - 2)
        time.sleep(min(delay, MAX_RESTART_DELAY_S))
        with self._sending:
            new = self._start_child(child.generation + 1)
            with self._changed:
                self._child = new
                self._restarts += 1
                if self._ledger.closed and not any(message.body[0] == "close" for message in self._outbox):
                    self._hand_over(("close", self._close_timeout_s), 0)  # the dead child took the first
                self._changed.notify_all()
        self._listen(new)
