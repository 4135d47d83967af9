"""The history writer in a process of its own: the engine's process only encodes rows and writes bytes.

`WriterProcess` has `EventWriter`'s interface and contract (see storage.writer) and runs an
`EventWriter` in a child process (`python -m storage.writer_process`), so the database work (SQLite's
inserts, the writer's Python and its hold on the GIL) never runs in the engine's interpreter: a writer
thread's batches lengthened the engine steps they overlapped while the GIL went back and forth. The
child still needs CPU time, so on a machine with fewer free cores than the engine can use, steps still
feel it (see benchmarks/storage.py for the numbers).

Data flow, one way:
    engine thread: encode, hold --(every batch_interval_s: one frame)--> pipe --> child: EventWriter
    child: stats, flush and close replies --> pipe --> receiver thread --> `stats()`, `flush()`, `close()`

    * `submit` encodes events on the calling thread as the writer stores them (`encode_events`: one
      orjson call, ~0.3 us an event; EVICT events also travel as tuples, for the eviction log) and holds
      the encoded bytes (not the events: held rows are no work for the garbage collector).
      `record_requests` holds only the latest view of each request (the engine republishes every
      running request every step, and a view carries its whole prompt).
    * What is held goes out as one frame at most every `batch_interval_s`, when the held events would
      pass `item_rows`, before a new run starts, on `flush` and `close`, and from the pipe's thread when
      the engine has gone quiet. The frame is written straight into the pipe (storage.frame_pipe: one
      non-blocking write on the calling thread, no hand-off); only when the child lags does it wait in
      the pipe's backlog, of at most `queue_items` frames. A frame refused there is dropped and its rows
      counted in `stats().dropped`. A frame holds whole `submit` chunks, at most `item_rows` events, and
      the child writes its events as one atomic item; the child neither rebuilds nor re-encodes them.
      A superseded request view counts as written (as `EventWriter` counts the views it coalesces)
      once its successor is sent, and as dropped if its successor is.
    * Control frames (`start_run`, `flush`, `close`) are never dropped; frames reach the child in order,
      so a run's rows always follow its run.
    * `stats()` is the child writer's latest report (it reports whenever its counters change, at most
      every `poll_s`, and with every flush reply), merged with what this side counts: rows held or not
      yet confirmed by the child are `queued`, rows dropped here are in `dropped`.
    * If the child dies, that is reported (`last_error`), every row it had not confirmed is counted as
      dropped, and the engine keeps serving. If this process dies, the child sees the pipe close,
      writes everything it received and exits: a killed engine loses what it held (at most
      `batch_interval_s` of rows), a killed child at most what it had not committed.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.events import Event
from engine.snapshot import RequestView
from storage.db import db_engine
from storage.frame_pipe import FramePipe, read_frames, write_frame
from storage.rows import (
    EncodedEvents,
    checked_events,
    checked_views,
    encode_events,
    join_encoded,
    view_without_prompt,
)
from storage.writer import EventWriter, RunInfo, WriterOptions, WriterStats, new_run_id

ROOT = Path(__file__).resolve().parents[1]
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
# The child yields its core to the engine's threads whenever they are runnable (measured: without it the
# tiny model's steps were a few percent slower while batches were written). Under sustained full load
# it still gets a small share; if that is too little, its bounded queues drop rows and count them.
CHILD_NICENESS = 19
EMPTY_EVENTS = EncodedEvents("[]", 0, ())
CLOSE_FRAME = pickle.dumps(("close",), PICKLE_PROTOCOL)
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

    @property
    def num_rows(self) -> int:
        return self.num_events + len(self.requests)


class WriterProcess:
    """`EventWriter`'s interface, with the writer in a child process. See the module docstring."""

    def __init__(self, url: str, options: WriterOptions | None = None) -> None:
        """Start the child for `url` (any SQLAlchemy URL; see `storage.db.default_db_url`).

        Raises:
            sqlalchemy.exc.ArgumentError (or the driver's ImportError): `url` cannot name a database,
                as `EventWriter` raises it. An unreachable database is reported in `stats()` instead.
        """
        self._options = options or WriterOptions()
        db_engine(url).dispose()  # a malformed URL or a missing driver fails here, not in the child
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "storage.writer_process", str(to_child_read), str(from_child_write)],
                pass_fds=(to_child_read, from_child_write),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": python_path},
            )
        finally:
            os.close(to_child_read)
            os.close(from_child_write)
        self._from_child = os.fdopen(from_child_read, "rb")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._accepted_rows = 0  # every event and request view handed in (held, sent, refused)
        self._superseded = 0  # request views replaced by a later one of the same request, then sent
        self._dropped_here = 0  # rows refused on this side: backlog full, closed, child gone
        self._child_stats = NO_STATS
        self._child_gone = False  # its pipe closed: it exited (after close, or not)
        self._child_error: str | None = None  # why it exited before close, if it did
        self._send_error: str | None = None  # why the latest rows that could not be sent were not
        self._flushed: dict[int, bool] = {}  # flush token -> the child's answer
        self._closed_by_child = False  # it answered close (and exits)
        self._tokens = itertools.count(1)
        self._held = _Held()
        self._sending = threading.Lock()  # one sender of held rows at a time (see `_send_held`)
        self._send_due = 0.0  # monotonic time after which held rows go out with the next call
        self._current_run: str | None = None
        self._close_called = False
        self._closed = False
        self._to_child = FramePipe(
            to_child_write, self._options.queue_items, self._send_held_if_due, self._options.batch_interval_s
        )
        self._send_control(("open", url, self._options))
        self._receiver = threading.Thread(target=self._receive, name="writer-process-receiver", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int:
        """The writer process's id."""
        return self._process.pid

    # ---- engine side: never waits on the database --------------------------------------------

    def start_run(self, info: RunInfo) -> str:
        """Record a new engine start (stopping the previous run) and return its id."""
        run_id = new_run_id(info.started_at)
        self._send_held()  # they belong to the run before
        self._current_run = run_id
        self._send_control(("run", run_id, info))
        return run_id

    def submit(self, events: Sequence[Event]) -> None:
        """Queue events of the current run (see `EventWriter.submit`).

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.events.Event` (nothing is queued).
        """
        self._require_run()
        checked_events(events)
        size = self._options.item_rows
        for start in range(0, len(events), size):  # each chunk one atomic item, as EventWriter.submit does
            chunk = encode_events(events[start : start + size])
            with self._lock:
                self._accepted_rows += chunk.count
                if self._refusing_rows():
                    self._dropped_here += chunk.count
                    continue
                frame_full = self._held.num_events + chunk.count > size
            if frame_full:
                self._send_held()
            with self._lock:
                self._held.events.append(chunk)
                self._held.num_events += chunk.count
        self._send_held_if_due()

    def record_requests(self, views: Iterable[RequestView]) -> None:
        """Queue request views of the current run (see `EventWriter.record_requests`).

        Raises:
            RuntimeError: no run was started.
            TypeError: an element is not an `engine.snapshot.RequestView` (nothing is queued).
            ValueError: a view lacks a required field (nothing is queued).
        """
        self._require_run()
        views = checked_views(views)
        with self._lock:
            self._accepted_rows += len(views)
            if self._refusing_rows():
                self._dropped_here += len(views)
                return
            held = self._held.requests
            num_before = len(held)
            for view in views:
                held[view.request_id] = view
            self._held.superseded += len(views) - (len(held) - num_before)
        self._send_held_if_due()

    def stats(self) -> WriterStats:
        with self._lock:
            child = self._child_stats
            written_requests = child.written_requests + self._superseded  # as EventWriter counts them
            written = child.written_events + written_requests
            if self._child_gone:  # what it never confirmed as written is lost
                queued, dropped = 0, self._accepted_rows - written
            else:
                dropped = child.dropped + self._dropped_here
                queued = self._accepted_rows - written - dropped
            return replace(
                child,
                written_requests=written_requests,
                queued=queued,
                dropped=dropped,
                retrying=child.retrying and not self._child_gone,
                last_error=self._child_error or self._send_error or child.last_error,
            )

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call was written or dropped by the child.

        Returns:
            False if `timeout_s` passed first. Check `stats()` for what was dropped.
        """
        token = next(self._tokens)
        self._send_held()
        self._send_control(("flush", token, timeout_s))
        with self._changed:
            self._changed.wait_for(lambda: token in self._flushed or self._child_gone, timeout_s)
            return self._flushed.pop(token, self._child_gone)  # a child that is gone holds nothing more

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Stop the current run, let the child write what it got, and wait for it to exit.

        Rows handed over after close are dropped and counted.

        Returns:
            False if the child was still working after `timeout_s` (it finishes on its own).
        """
        with self._lock:
            first_call, self._close_called = not self._close_called, True
        if first_call:
            self._send_held()
            with self._lock:
                self._closed = True  # rows from now on are dropped
            self._send_control(("close",))
            self._to_child.close()
        with self._changed:
            return self._changed.wait_for(lambda: self._child_gone, timeout_s)

    def _require_run(self) -> None:
        if self._current_run is None:
            raise RuntimeError("start_run() before submitting rows")

    def _refusing_rows(self) -> bool:
        """Closed, or the child is gone (the lock held)."""
        return self._closed or self._child_gone

    def _send_held_if_due(self) -> None:
        if time.monotonic() >= self._send_due:
            self._send_held()

    def _send_held(self) -> None:
        """Send every held row as one frame. One sender at a time (the engine thread, a flush, or the
        pipe's thread when the engine is quiet), so an older frame can never follow a newer one."""
        with self._sending:
            with self._lock:
                held, self._held = self._held, _Held()
                self._send_due = time.monotonic() + self._options.batch_interval_s
                if not held.num_rows:
                    return
                if self._refusing_rows():
                    self._dropped_here += held.num_rows + held.superseded
                    return
            # Plain tuples: the pickle module handles them in C, NamedTuples and enums in Python.
            events = join_encoded(held.events) if held.events else EMPTY_EVENTS
            evictions = list(map(tuple, events.evictions))
            requests = list(map(view_without_prompt, held.requests.values()))
            message = ("rows", events.json, events.count, evictions, requests)
            try:
                payload = pickle.dumps(message, PICKLE_PROTOCOL)
            except Exception as error:  # a view holding what cannot cross (a lock, a lambda): counted, shown
                with self._lock:
                    self._dropped_here += held.num_rows + held.superseded
                    reason = f"{type(error).__name__}: {error}"
                    self._send_error = f"rows could not be sent to the writer process: {reason}"
                return
            sent = self._to_child.send(payload)
            with self._lock:
                if sent:  # superseded views count as written once their successors are on the way
                    self._superseded += held.superseded
                else:
                    self._dropped_here += held.num_rows + held.superseded

    def _send_control(self, message: tuple) -> None:
        self._to_child.send(pickle.dumps(message, PICKLE_PROTOCOL), droppable=False)

    # ---- receiver thread -----------------------------------------------------------------------

    def _receive(self) -> None:
        """Keep the child's latest stats and answers until its pipe closes."""
        for payload in read_frames(self._from_child):
            message = pickle.loads(payload)
            kind, stats = message[0], message[-1]
            with self._changed:
                self._child_stats = stats
                if kind == "flushed":
                    self._flushed[message[1]] = message[2]
                elif kind == "closed":
                    self._closed_by_child = True
                self._changed.notify_all()
        self._from_child.close()
        returncode = self._process.wait()
        with self._changed:
            self._child_gone = True
            if not self._closed_by_child:
                self._child_error = f"the writer process exited (code {returncode}) before close"
            self._changed.notify_all()


# ---- the child -----------------------------------------------------------------------------------


def serve(read_fd: int, write_fd: int) -> None:
    """The child's main loop: run an EventWriter on what arrives, report its stats, answer flush/close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the parent; it closes us
    os.nice(CHILD_NICENESS)
    outbox = os.fdopen(write_fd, "wb")
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            try:
                write_frame(outbox, pickle.dumps(message, PICKLE_PROTOCOL))
            except OSError:  # the parent is gone; the writer still finishes what it has
                pass

    frames = read_frames(os.fdopen(read_fd, "rb"))
    opening = next(frames, None)  # the first frame: ("open", url, options)
    if opening is None:  # the parent died before it asked for anything
        return
    _, url, options = pickle.loads(opening)
    writer = EventWriter(url, options)
    closing = threading.Event()

    def report() -> None:
        last = None
        while not closing.wait(options.poll_s):
            stats = writer.stats()
            if stats != last:
                send(("stats", stats))
                last = stats

    def answer_flush(token: int, timeout_s: float | None) -> None:
        flushed = writer.flush(timeout_s)
        send(("flushed", token, flushed, writer.stats()))

    threading.Thread(target=report, name="writer-stats", daemon=True).start()
    while True:
        # The parent died without closing when its pipe ends first: write what we have.
        message = pickle.loads(next(frames, CLOSE_FRAME))
        kind = message[0]
        if kind == "rows":
            _, json, count, evictions, requests = message
            if count:
                writer.submit_encoded(EncodedEvents(json, count, tuple(map(Event._make, evictions))))
            if requests:
                writer.record_requests(list(map(RequestView._make, requests)))
        elif kind == "run":
            writer.start_run(message[2], run_id=message[1])
        elif kind == "flush":  # answered by a thread, so frames behind it keep flowing in
            threading.Thread(target=answer_flush, args=message[1:], daemon=True).start()
        elif kind == "close":  # no timeout here: the parent's close waits as long as it wants to
            writer.close(None)
            closing.set()
            send(("closed", writer.stats()))
            return
        else:
            raise ValueError(f"unknown message {kind!r}")


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
