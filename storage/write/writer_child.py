"""The writer process itself (`python -m storage.write.writer_child READ_FD WRITE_FD`), started by
storage.write.writer_process.WriterProcess: an `EventWriter` fed from a pipe, reporting its progress back.

Messages in (pickled tuples, one per frame, in order):
    ("open", url, options, writer_id)          first; the writer's progress key is writer_id (storage.write.progress)
    ("runs", {run_id: (info, stopped_at)})     a replacement child: every run its parent started
    ("run", frame, run_id, info)               a new run (frame: its number, done once the run row commits)
    ("rows", frame, json, count, evictions, views, superseded)   one frame of rows, one atomic item
    ("hurry",)                                 write what has arrived without waiting for more
    ("close", timeout_s)                       stop the run, write the rest (give up failing batches after
                                               timeout_s), report and exit
Reports out: ("stats", stats, done_frame, dropped_frames) after every transaction (at most every poll_s
while nothing is done), and ("closed", stats, done_frame, dropped_frames) last. Every frame up to
done_frame, and the ones in dropped_frames, is written or dropped.

If the parent dies, the pipe ends: the child writes everything it received, stops the run and exits.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from collections import deque
from dataclasses import replace

from engine.core.events import Event
from engine.core.snapshot import RequestView
from storage.write.frame_pipe import read_frames, write_frame
from storage.write.rows import EncodedEvents
from storage.write.writer import EventWriter, WriterStats

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
CLOSE_FRAME = pickle.dumps(("close", None), PICKLE_PROTOCOL)  # what the child does when its parent is gone


class _FrameLedger:
    """The child's map from the parent's frame numbers to its writer's marks."""

    def __init__(self, writer: EventWriter) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._marks: deque[tuple[int, int]] = deque()  # (frame number, the writer's mark after it), queued frames
        self._dropped: list[int] = []  # frames dropped at once (a full queue), not reported yet
        self._done_frame = 0

    def received(self, frame: int, queued: bool) -> None:
        """`frame` was handed to the writer, which queued it (or dropped it at once)."""
        with self._lock:
            if queued:
                self._marks.append((frame, self._writer.mark()))
            else:
                self._dropped.append(frame)

    def report(self) -> tuple[WriterStats, int, tuple[int, ...]]:
        """The writer's stats, the newest frame up to which every frame is written or dropped, and the
        later frames dropped at once; all three consistent."""
        stats = self._writer.stats()
        with self._lock:
            while self._marks and self._marks[0][1] <= stats.done_mark:
                self._done_frame = self._marks.popleft()[0]
            dropped, self._dropped = tuple(self._dropped), []
            return stats, self._done_frame, dropped


def serve(read_fd: int, write_fd: int) -> None:
    """The child's main loop: run an EventWriter on what arrives, report its progress, answer close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the parent; it closes us
    outbox = os.fdopen(write_fd, "wb")
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            try:
                write_frame(outbox, pickle.dumps(message, PICKLE_PROTOCOL))
            except OSError:  # the parent is gone; the writer still finishes what it has
                pass

    frames = read_frames(os.fdopen(read_fd, "rb"))
    opening = next(frames, None)  # the first frame: ("open", url, options, writer id)
    if opening is None:  # the parent died before it asked for anything
        return
    _, url, options, writer_id = pickle.loads(opening)
    if options.child_niceness:
        os.nice(options.child_niceness)  # after the imports: starting up is not slowed
    # Rows reach the child once they have waited batch_interval_s on the engine side: write them now.
    writer = EventWriter(url, replace(options, batch_interval_s=0.0), progress_key=writer_id)
    ledger = _FrameLedger(writer)
    closing = threading.Event()

    def report() -> None:
        """Report after every transaction (at most every poll_s while nothing is done) when anything changed."""
        last = None
        done_mark = 0
        while not closing.is_set():
            writer.wait_for_progress(done_mark, options.poll_s)
            stats, done_frame, dropped = ledger.report()
            key = (replace(stats, lag_s=0.0), done_frame)
            if key != last or dropped:
                send(("stats", stats, done_frame, dropped))
                last = key
            done_mark = stats.done_mark

    threading.Thread(target=report, name="writer-stats", daemon=True).start()
    while True:
        # The parent died without closing when its pipe ends first: write what we have.
        message = pickle.loads(next(frames, CLOSE_FRAME))
        kind = message[0]
        if kind == "rows":
            _, frame, json, count, evictions, requests, superseded = message
            encoded = EncodedEvents(json, count, tuple(map(Event._make, evictions)))
            ledger.received(frame, writer.submit_frame(encoded, tuple(map(RequestView._make, requests)), superseded))
        elif kind == "run":
            _, frame, run_id, info = message
            writer.start_run(info, run_id=run_id)
            ledger.received(frame, queued=True)
        elif kind == "runs":
            writer.restore_runs(message[1])
        elif kind == "hurry":
            writer.hurry(writer.mark())
        elif kind == "close":  # failing batches are given up after the parent's timeout; then wait for the end
            if not writer.close(message[1]):
                writer.close(None)
            closing.set()
            send(("closed", *ledger.report()))
            return
        else:
            raise ValueError(f"unknown message {kind!r}")


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
