"""The history writer in a process of its own: the engine's process only encodes rows and writes bytes.

`WriterProcess` has `EventWriter`'s interface and contract (see storage.write.writer) and runs an
`EventWriter` in a child process (storage.write.writer_child), so the database work (SQLite's inserts, the
writer's Python and its hold on the GIL) never runs in the engine's interpreter: a writer thread's
batches lengthened the engine steps they overlapped while the GIL went back and forth. The child still
needs CPU time, so on a machine with fewer free cores than the engine can use, steps still feel it (see
benchmarks/storage.py for the numbers).

Data flow, one way:
    engine thread: encode, hold --(one frame per batch_interval_s)--> pipe --> child: EventWriter
    child: stats and "written up to frame F" --> pipe --> receiver thread --> `stats()`, `wait()`, `close()`

    * `submit` encodes events on the calling thread as the writer stores them (`encode_events`: one
      orjson call, ~0.3 us an event; EVICT events also travel as tuples, for the eviction log) and holds
      the encoded bytes (not the events: held rows are no work for the garbage collector).
      `record_requests` holds only the latest view of each request (the engine republishes every
      running request every step, and a view carries its whole prompt).
    * What is held goes out as one frame once its oldest row is `batch_interval_s` old (checked on every
      call and by the pipe's thread every `batch_interval_s / 5`), when the held events would pass
      `item_rows`, before a new run starts, on `wait`/`flush` and on `close`. The frame is written
      straight into the pipe (storage.write.frame_pipe: one non-blocking write on the calling thread, no
      hand-off); only when the child lags does it wait in the pipe's backlog, of at most `queue_items`
      frames. A frame refused there is dropped and its rows counted in `stats().dropped`. A frame is
      one atomic item in the child (its events, its views and the views they superseded), written in
      one transaction; the child neither rebuilds nor re-encodes its events, and writes what arrives
      without waiting for more (its own `batch_interval_s` is 0: rows already waited here).
    * Frames of rows and of new runs are numbered. The child reports after every transaction which are
      done (written or dropped); `mark()` is the number of the frame that will carry the rows handed
      over so far (or of the newest, when nothing is held), and `wait(mark, timeout_s)` sends them at
      once, tells the child to hurry and waits for that report: the console's read-your-writes.
      `stats().lag_s` is the age of the oldest row not done.
    * Control frames (`start_run`, hurry, `close`) are never dropped; frames reach the child in order,
      so a run's rows always follow its run.
    * Counting: `written_*` are the child's (saved in the database inside every transaction, see
      storage.write.progress), `queued` is every row held or in a frame not done, and `dropped` is the rest of
      what was handed over. So written + queued + dropped == handed over, always, and exactly.

Visibility latency (the documented bound; benchmarks/storage.py section 4 measures it, and
tests/test_under_load.py holds it): a row is committed within `batch_interval_s` + 1/5 of it + the
child's transaction times, at most ~0.7 s when the child keeps up. The child runs at `child_niceness`
(default 0, the engine's own priority), so two CPU-bound processes beside the engine slow it by their
fair share instead of starving it: at nice 19 it got ~1.5% of a busy core, and rows waited up to 17 s.
The bound: p99 under 2 s and every row under 5 s, with two busy processes on this 2-core machine. The
price: when the machine is oversubscribed, the child takes its CPU time when it needs it, from the
engine too, instead of falling behind.

Faults:
    * The child killed or crashed: the receiver thread sees its pipe close and starts a new child (at
      once; after the second child in a row that lived under `QUICK_EXIT_S`, with a backoff doubling
      up to `MAX_RESTART_DELAY_S`), which first reads what its predecessors committed (storage.write.progress):
      the rows they had not committed count as dropped, exactly. The run rows and stop times are sent
      again; history goes on. `stats().restarts` counts restarts, `last_error` says why.
    * This process dies: the child sees the pipe close, writes everything it received and exits. A
      killed engine loses what it held (at most `batch_interval_s` of rows).
    * Database faults (locked, full, read-only, unreachable) are the child writer's (storage.write.writer):
      retried for up to `retry_for_s`, rows waiting in bounded queues meanwhile.
"""

from __future__ import annotations

import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.core.events import Event
from engine.core.snapshot import RequestView
from storage.db import db_engine
from storage.write.frame_pipe import FramePipe, read_frames
from storage.write.rows import (
    EncodedEvents,
    checked_events,
    checked_views,
    encode_events,
    join_encoded,
    view_without_prompt,
)
from storage.write.writer import RunInfo, WriterOptions, WriterStats, new_run_id

ROOT = Path(__file__).resolve().parents[2]
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
EMPTY_EVENTS = EncodedEvents("[]", 0, ())
HURRY_FRAME = pickle.dumps(("hurry",), PICKLE_PROTOCOL)
TICKS_PER_INTERVAL = 5  # the pipe's thread checks for held rows that are due this often per batch_interval_s
QUICK_EXIT_S = 5.0  # a child that exits sooner than this after its start counts as a quick exit
FIRST_RESTART_DELAY_S = 0.5  # the wait before a restart after two quick exits in a row; doubles with each more
MAX_RESTART_DELAY_S = 30.0
NO_STATS = WriterStats(
    queued=0, written_events=0, written_requests=0, written_batches=0, dropped=0, failed_batches=0, retries=0,
    retrying=False, last_error=None, schema_ready=False, pruned_rows=0,
)  # fmt: skip


@dataclass
class _Held:
    """Rows accepted on the engine side and not sent yet."""

    events: list[EncodedEvents] = field(default_factory=list)  # one per submit chunk, in order
    num_events: int = 0
    requests: dict[str, RequestView] = field(default_factory=dict)  # request id -> its latest view
    superseded: int = 0  # request views replaced in `requests` by a later one of the same request
    since: float = 0.0  # monotonic time the oldest of these rows was handed over

    @property
    def num_rows(self) -> int:
        return self.num_events + len(self.requests) + self.superseded


@dataclass(frozen=True)
class _Frame:
    """A frame of rows (or a new run) on its way: sent (or being sent) to a child, not yet reported done."""

    seq: int  # frame number, in sending order; `mark()` and `wait()` name frames
    num_rows: int  # events, views and the views they superseded (0 for a run's frame)
    since: float  # monotonic time its oldest row was handed over
    generation: int  # the child it went to


class _Child:
    """One writer process: its pipe, the thread that reads its reports, and when it started."""

    def __init__(self, generation: int, writer: WriterProcess) -> None:
        self.generation = generation
        self.started = time.monotonic()
        self.answered_close = False  # it reported "closed" (and exits)
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "storage.write.writer_child", str(to_child_read), str(from_child_write)],
                pass_fds=(to_child_read, from_child_write),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": python_path},
            )
        finally:
            os.close(to_child_read)
            os.close(from_child_write)
        tick_s = writer.options.batch_interval_s / TICKS_PER_INTERVAL
        self.pipe = FramePipe(to_child_write, writer.options.queue_items, writer.send_due_rows, tick_s)
        self._from_child = os.fdopen(from_child_read, "rb")
        self._writer = writer

    def listen(self) -> None:
        """Start handing its reports to the writer (once the writer knows it as its running child)."""
        threading.Thread(target=self._receive, name="writer-process-receiver", daemon=True).start()

    def send_control(self, message: tuple) -> None:
        self.pipe.send(pickle.dumps(message, PICKLE_PROTOCOL), droppable=False)

    def _receive(self) -> None:
        """Hand the child's reports to the writer until its pipe closes, then say that it exited."""
        for payload in read_frames(self._from_child):
            self._writer.child_reported(self, *pickle.loads(payload))
        self._from_child.close()
        self._writer.child_exited(self, self.process.wait())


class WriterProcess:
    """`EventWriter`'s interface, with the writer in a child process. See the module docstring."""

    def __init__(self, url: str, options: WriterOptions | None = None) -> None:
        """Start the child for `url` (any SQLAlchemy URL; see `storage.db.default_db_url`).

        Raises:
            storage.db.DatabaseUrlError: `url` cannot name a database this process can use, as
                `EventWriter` raises it. An unreachable database is reported in `stats()` instead.
        """
        self.options = options or WriterOptions()
        db_engine(url).dispose()  # a malformed URL or a missing driver fails here, not in the child
        self._url = url
        self._writer_id = secrets.token_hex(8)  # its progress row in the database (storage.write.progress)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._sending = threading.Lock()  # one sender at a time, so frames leave in the order of their numbers
        self._accepted_rows = 0  # every event and request view handed in
        self._held = _Held()
        self._next_frame = 1
        self._frames: dict[int, _Frame] = {}  # frames not reported done, by number (in sending order)
        self._frame_rows = 0  # rows in them
        self._written = (0, 0)  # (events, requests) committed, as the newest child that knows reported it
        self._child_stats = NO_STATS  # the running child's latest report
        self._past = NO_STATS  # counters of children that exited (batches, failures, retries, pruned rows)
        self._last_error: str | None = None
        self._restarts = 0
        self._quick_exits = 0  # children in a row that exited soon after their start
        self._resolving = False  # a new child has not yet said what its predecessors committed
        self._runs: dict[str, tuple[RunInfo, float | None]] = {}  # every run started: info, stopped_at
        self._current_run: str | None = None
        self._closed = False  # close() started: rows from now on are dropped
        self._close_timeout_s: float | None = None  # how long the first close() call waits
        self._gone = False  # the child answered close and exited
        with self._sending:
            self._child = self._start_child(0)
        self._child.listen()

    @property
    def pid(self) -> int:
        """The running writer process's id."""
        with self._lock:
            return self._child.process.pid

    # ---- engine side: never waits on the database --------------------------------------------

    def start_run(self, info: RunInfo) -> str:
        """Record a new engine start (stopping the previous run) and return its id."""
        run_id = new_run_id(info.started_at)
        with self._sending:
            with self._lock:
                taken = self._take_held()  # they belong to the run before
                if self._current_run is not None:
                    self._runs[self._current_run] = (self._runs[self._current_run][0], info.started_at)
                self._runs[run_id] = (info, None)
                self._current_run = run_id
                run_frame = self._number_frame(0, time.monotonic())  # done once the run row is committed
                child = self._child
            if taken is not None:
                self._send_frame(child, *taken)
            child.send_control(("run", run_frame.seq, run_id, info))
        return run_id

    def submit(self, events: Sequence[Event]) -> None:
        """Queue events of the current run (see `EventWriter.submit`).

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.core.events.Event` (nothing is queued).
        """
        self._require_run()
        checked_events(events)
        size = self.options.item_rows
        for start in range(0, len(events), size):  # each chunk one atomic item, as EventWriter.submit does
            chunk = encode_events(events[start : start + size])
            with self._lock:
                if self._closed or self._held.num_events + chunk.count <= size or not self._held.num_events:
                    self._accepted_rows += chunk.count
                    if not self._closed:  # after close: dropped, as neither written nor queued
                        self._hold_events(chunk)
                    continue
            with self._sending:  # the held frame is full: send it, then hold the chunk
                with self._lock:
                    self._accepted_rows += chunk.count
                    if self._closed:
                        continue
                    taken, child = self._take_held(), self._child
                    self._hold_events(chunk)
                if taken is not None:
                    self._send_frame(child, *taken)
        self.send_due_rows()

    def record_requests(self, views: Iterable[RequestView]) -> None:
        """Queue request views of the current run (see `EventWriter.record_requests`).

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.core.snapshot.RequestView` (nothing is queued).
            ValueError: a view lacks a required field (nothing is queued).
        """
        self._require_run()
        views = checked_views(views)
        with self._lock:
            self._accepted_rows += len(views)
            if self._closed or not views:
                return
            held = self._held
            if not held.num_rows:
                held.since = time.monotonic()
            num_before = len(held.requests)
            for view in views:
                held.requests[view.request_id] = view
            held.superseded += len(views) - (len(held.requests) - num_before)
        self.send_due_rows()

    def stats(self) -> WriterStats:
        with self._lock:
            child, past = self._child_stats, self._past
            written_events, written_requests = self._written
            queued = self._held.num_rows + self._frame_rows
            first_frame = next(iter(self._frames.values()), None)
            oldest = [self._held.since] if self._held.num_rows else []
            oldest += [] if first_frame is None else [first_frame.since]
            return WriterStats(
                queued=queued,
                written_events=written_events,
                written_requests=written_requests,
                written_batches=past.written_batches + child.written_batches,
                dropped=self._accepted_rows - written_events - written_requests - queued,
                failed_batches=past.failed_batches + child.failed_batches,
                retries=past.retries + child.retries,
                retrying=child.retrying,
                last_error=self._last_error,
                schema_ready=child.schema_ready,
                pruned_rows=past.pruned_rows + child.pruned_rows,
                lag_s=time.monotonic() - min(oldest) if oldest else 0.0,
                done_mark=self._done_through(),
                restarts=self._restarts,
            )

    def mark(self) -> int:
        """A mark for every row (and run) handed over so far: the number of the frame that carries the newest."""
        with self._lock:
            return self._next_frame if self._held.num_rows else self._next_frame - 1

    def wait(self, mark: int, timeout_s: float | None = None) -> bool:
        """Send the rows up to `mark`, have the child write them without waiting for more, and wait until
        they are written or dropped.

        Returns:
            False if `timeout_s` passed first. Check `stats()` for what was dropped.
        """
        with self._lock:
            if self._done_through() >= mark:
                return True
        self.hurry(mark)
        with self._changed:
            return self._changed.wait_for(lambda: self._done_through() >= mark or self._gone, timeout_s)

    def hurry(self, mark: int) -> None:
        """Send the rows up to `mark` now and have the child write them without waiting for more."""
        with self._sending:
            with self._lock:
                taken = self._take_held() if mark >= self._next_frame else None
                child = self._child
            if taken is not None:
                self._send_frame(child, *taken)
            child.pipe.send(HURRY_FRAME, droppable=False)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call was written or dropped (`wait(mark())`)."""
        return self.wait(self.mark(), timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Stop the current run, let the child write what it got, and wait for it to exit.

        Rows handed over after close started are dropped and counted.

        Returns:
            False if the child was still working after `timeout_s` (it finishes on its own).
        """
        with self._sending:
            with self._lock:
                first_call, self._closed = not self._closed, True
                taken = self._take_held() if first_call else None
                child = self._child
            if taken is not None:
                self._send_frame(child, *taken)
            if first_call:
                self._close_timeout_s = timeout_s
                child.send_control(("close", timeout_s))
                child.pipe.close()
        with self._changed:
            return self._changed.wait_for(lambda: self._gone, timeout_s)

    def send_due_rows(self) -> None:
        """Send the held rows if the oldest has waited `batch_interval_s` (the pipe's thread calls it too)."""
        held = self._held
        if held.num_rows and time.monotonic() >= held.since + self.options.batch_interval_s:
            self._send_held()

    def _require_run(self) -> None:
        if self._current_run is None:
            raise RuntimeError("start_run() before submitting rows")

    def _hold_events(self, chunk: EncodedEvents) -> None:
        """Hold an encoded submit chunk (the lock held)."""
        held = self._held
        if not held.num_rows:
            held.since = time.monotonic()
        held.events.append(chunk)
        held.num_events += chunk.count

    def _take_held(self) -> tuple[_Frame, _Held] | None:
        """Number the held rows as the next frame, on its way to the running child (the lock and
        `_sending` held; the caller sends it)."""
        held = self._held
        if not held.num_rows:
            return None
        self._held = _Held()
        return self._number_frame(held.num_rows, held.since), held

    def _number_frame(self, num_rows: int, since: float) -> _Frame:
        """The next frame, on its way to the running child (the lock and `_sending` held)."""
        frame = _Frame(self._next_frame, num_rows, since, self._child.generation)
        self._next_frame += 1
        self._frames[frame.seq] = frame
        self._frame_rows += num_rows
        return frame

    def _send_held(self) -> None:
        with self._sending:
            with self._lock:
                taken, child = self._take_held(), self._child
            if taken is not None:
                self._send_frame(child, *taken)

    def _send_frame(self, child: _Child, frame: _Frame, held: _Held) -> None:
        """Write a frame to `child` (`_sending` held). One that cannot be sent is dropped: counted, and why
        is kept in `last_error`."""
        # Plain tuples: the pickle module handles them in C, NamedTuples and enums in Python.
        events = join_encoded(held.events) if held.events else EMPTY_EVENTS
        evictions = list(map(tuple, events.evictions))
        requests = list(map(view_without_prompt, held.requests.values()))
        message = ("rows", frame.seq, events.json, events.count, evictions, requests, held.superseded)
        try:
            payload = pickle.dumps(message, PICKLE_PROTOCOL)
        except Exception as error:  # a view holding what cannot cross (a lock, a lambda): counted, shown
            reason = f"rows could not be sent to the writer process: {type(error).__name__}: {error}"
        else:
            if child.pipe.send(payload):
                return
            # Refused: the child lags by queue_items frames, or it exited (and `last_error` says so).
            exited = child.process.poll() is not None
            reason = None if exited else f"the writer process lags {self.options.queue_items} frames behind"
        with self._changed:
            self._forget_frame(frame)
            self._last_error = reason or self._last_error
            self._changed.notify_all()

    def _forget_frame(self, frame: _Frame) -> None:
        """The frame is done: written or dropped (the lock held)."""
        del self._frames[frame.seq]
        self._frame_rows -= frame.num_rows

    def _done_through(self) -> int:
        """Every frame up to this number is written or dropped (the lock held)."""
        return next(iter(self._frames), self._next_frame) - 1

    # ---- the children ------------------------------------------------------------------------

    def _start_child(self, generation: int) -> _Child:
        """Start a child and tell it the database, and the runs when it replaces one (`_sending` held)."""
        child = _Child(generation, self)
        child.send_control(("open", self._url, self.options, self._writer_id))
        with self._lock:
            runs = dict(self._runs)
        if runs:
            child.send_control(("runs", runs))
        return child

    def child_reported(
        self, child: _Child, kind: str, stats: WriterStats, done_frame: int, dropped: tuple[int, ...]
    ) -> None:
        """A report of `child` (its receiver thread): its stats, that every frame it got up to `done_frame`
        is done, and the later frames it dropped at once."""
        with self._changed:
            if child is not self._child:
                return
            if stats.last_error is not None and stats.last_error != self._child_stats.last_error:
                self._last_error = stats.last_error
            self._child_stats = stats
            if stats.schema_ready:  # it has read what every child before it committed
                if self._resolving:
                    for frame in [f for f in self._frames.values() if f.generation < child.generation]:
                        self._forget_frame(frame)
                    self._resolving = False
                self._written = (stats.written_events, stats.written_requests)
            done = set(dropped)
            for frame in [f for f in self._frames.values() if f.seq <= done_frame or f.seq in done]:
                if frame.generation == child.generation:
                    self._forget_frame(frame)
            if kind == "closed":  # it got every frame before close: what is still open belongs to a
                child.answered_close = True  # killed predecessor the database could not tell about: dropped
                for frame in list(self._frames.values()):
                    self._forget_frame(frame)
            self._changed.notify_all()

    def child_exited(self, child: _Child, returncode: int) -> None:
        """`child` exited (its receiver thread): done if it answered close, else replace it."""
        child.pipe.close()  # its thread stops; frames still sent to it until it is replaced are lost
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
                self._resolving = True
                closed = self._closed
                self._changed.notify_all()
            new.listen()
            if closed:  # close went to the child that died: the new one still says what was committed
                new.send_control(("close", self._close_timeout_s))
                new.pipe.close()
