"""The writer process itself (`python -m storage.write.writer_child READ_FD WRITE_FD`), started by
storage.write.writer_process.WriterProcess: an `EventWriter` fed from a multiprocessing connection,
reporting its progress on another.

Messages in, in order, each `(number, kind, *arguments)`; numbered from 1 by the parent (0: unnumbered):
    (0, "open", url, options, writer_id)     first; the writer's progress key is writer_id (storage.write.progress)
    (0, "runs", {run_id: (info, stopped_at)})  a replacement child: every run its parent started
    (n, "run", run_id, info)                 a new run
    (n, "events", json, count, evictions, tier_moves)    one chunk of encoded events
                                             (storage.write.rows.encode_events), its EVICT events and its
                                             disk-tier events as plain tuples
    (n, "views", views)                      request views as plain tuples, without their prompts
    (n, "rows", rows, num_rows, write)       another producer's row set and its bulk function
    (n, "hurry")                             write what has arrived without waiting for more
    (n, "close", timeout_s)                  stop the run, write the rest (give up failing batches after
                                             timeout_s), report and exit
Each numbered message is one item of the writer's queue (or none). Reports out: ("stats", stats, done)
after every transaction (at most every poll_s while nothing is done), and ("closed", stats, done) last:
every message up to number `done` is written or dropped, and `stats` counts it so.

If the parent dies, the connection ends: the child writes everything it received, ends the run as
interrupted (its requests still waiting or running with it: storage.write.run_liveness) and exits.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import deque
from dataclasses import replace
from multiprocessing.connection import Connection

from engine.core.events import Event
from engine.core.snapshot import RequestView
from storage.write.rows import EncodedEvents
from storage.write.writer import EventWriter, WriterStats

PARENT_GONE = (0, "parent gone", None)  # what the child does when its parent's connection ends


class _Done:
    """Which of the parent's messages are done: each message's number, next to the writer's mark after it."""

    def __init__(self, writer: EventWriter) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._marks: deque[tuple[int, int]] = deque()  # (message number, the writer's mark after it)
        self._done = 0

    def received(self, number: int) -> None:
        """Message `number` was handed to the writer."""
        with self._lock:
            self._marks.append((number, self._writer.mark()))

    def report(self) -> tuple[WriterStats, int]:
        """The writer's stats and the newest message number up to which every message is done, consistent."""
        stats = self._writer.stats()
        with self._lock:
            while self._marks and self._marks[0][1] <= stats.done_mark:
                self._done = self._marks.popleft()[0]
            return stats, self._done


def serve(inbox: Connection, outbox: Connection) -> None:
    """The child's main loop: run an EventWriter on what arrives, report its progress, answer close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the parent; it closes us
    send_lock = threading.Lock()

    def send(report: tuple) -> None:
        with send_lock:
            try:
                outbox.send(report)
            except OSError:  # the parent is gone; the writer still finishes what it has
                pass

    try:
        _, _, url, options, writer_id = inbox.recv()
    except EOFError:  # the parent died before it asked for anything
        return
    if options.child_niceness:
        os.nice(options.child_niceness)  # after the imports: starting up is not slowed
    # The parent bounds what is in flight, so the child's queue needs no bound of its own.
    writer = EventWriter(url, replace(options, queue_items=0), progress_key=writer_id)
    done = _Done(writer)
    closing = threading.Event()

    def report() -> None:
        """Report after every transaction (at most every poll_s while nothing is done) when anything changed."""
        last = None
        done_mark = 0
        while not closing.is_set():
            writer.wait_for_progress(done_mark, options.poll_s)
            stats, done_number = done.report()
            key = (replace(stats, lag_s=0.0), done_number)
            if key != last:
                send(("stats", stats, done_number))
                last = key
            done_mark = stats.done_mark

    threading.Thread(target=report, name="writer-stats", daemon=True).start()
    while True:
        try:
            number, kind, *arguments = inbox.recv()
        except EOFError:  # the parent died without closing: write what we have
            number, kind, *arguments = PARENT_GONE
        if kind == "events":
            json, count, evictions, tier_moves = arguments
            objects = tuple(map(Event._make, evictions)), tuple(map(Event._make, tier_moves))
            writer.submit_encoded(EncodedEvents(json, count, *objects))
        elif kind == "views":
            writer.record_requests(map(RequestView._make, arguments[0]))
        elif kind == "rows":
            writer.submit_rows(*arguments)
        elif kind == "run":
            writer.start_run(arguments[1], run_id=arguments[0])
        elif kind == "runs":
            writer.restore_runs(arguments[0])
        elif kind == "hurry":
            writer.hurry(writer.mark())
        elif kind in ("close", "parent gone"):  # failing batches are given up after the timeout; then wait
            interrupted = kind == "parent gone"  # the engine died with its requests: the run ends interrupted
            if not writer.close(arguments[0], interrupted=interrupted):
                writer.close(None, interrupted=interrupted)
            closing.set()
            send(("closed", *done.report()))
            return
        else:
            raise ValueError(f"unknown message {kind!r}")
        if number:
            done.received(number)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
