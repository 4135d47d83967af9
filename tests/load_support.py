"""CPU load and the history's visibility latency, for tests/test_under_load.py and benchmarks/storage.py.

    with busy_loops(2, max_s=600):           # two CPU-bound processes of normal priority
        latencies = visibility_latencies(url, seconds=10)

`busy_loops` spin in processes of their own that end by themselves after `max_s`, even if whoever
started them dies. `visibility_latencies` feeds a WriterProcess (the console's settings) an engine-like
stream and measures, for every step, the time from its submit until a reader first finds it stored.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import func, select

from engine.core.events import Event, EventKind, EvictReason
from engine.core.snapshot import RequestView
from storage.db import db_engine
from storage.schema import EVENTS
from storage.write.writer import RunInfo, WriterOptions
from storage.write.writer_process import WriterProcess

STEP_S = 0.02  # the stream's step period
STEP_EVENTS = 80  # events a step, one EVICT in four
STEP_VIEWS = 8  # request views a step (the running requests, republished)
POLL_S = 0.01  # the reader's poll period: the measurement's resolution
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass"


@contextmanager
def busy_loops(count: int, max_s: float = 3600.0) -> Iterator[list[subprocess.Popen]]:
    """`count` processes that keep one core busy each until the block ends (or `max_s` passes)."""
    loops = [subprocess.Popen([sys.executable, "-c", SPIN, str(max_s)]) for _ in range(count)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def step_events(step: int, rng: random.Random) -> list[Event]:
    """One step's events: ALLOCATE, CACHE and RELEASE of blocks, and an LRU eviction every fourth."""
    events = []
    for i in range(STEP_EVENTS):
        block = rng.randrange(4096)
        if i % 4 == 0:
            detail = {
                "reason": EvictReason.LRU.value, "key": f"{rng.getrandbits(64):016x}", "start_pos": 0, "end_pos": 16,
                "age_s": rng.expovariate(1 / 120), "hit_count": rng.randrange(20), "last_used": time.time(),
                "group": "full",
            }  # fmt: skip
            events.append(Event(EventKind.EVICT, step, time.time(), f"req-{step}", block, 16, detail))
        else:
            kind = (EventKind.ALLOCATE, EventKind.CACHE, EventKind.RELEASE)[i % 3]
            events.append(Event(kind, step, time.time(), f"req-{step}", block, 16, {"group": "full"}))
    return events


def stream_view(index: int, step: int) -> RequestView:
    """A running request as the engine republishes it every step."""
    return RequestView(
        request_id=f"stream-{index}", parent_id=None, status="running", retain=False, salt=None,
        prompt_token_ids=(1, 2, 3), num_prompt_tokens=3, output_token_ids=(4,) * (step % 100), num_computed_tokens=3,
        cached_tokens=0, computed_tokens=3, hit_source="none", cow_copies=0, preemptions=0, finish_reason=None,
        arrival_time=time.time(), first_scheduled_time=None, first_token_time=None, finish_time=None,
        block_tables={}, max_new_tokens=128, window_start=0, window_end=0, replay_from=0, replay_mode="none",
        replayed_tokens=0, replay_divergence=None, block_keys=None, content_keys=None,
    )  # fmt: skip


def visibility_latencies(url: str, seconds: float, niceness: int = 0) -> list[float]:
    """Seconds from each step's submit until a reader first found its events stored, in step order.

    A fresh database: event ids then count the rows, so the newest complete step is max(id) / 80 - 1
    (one submit of 80 events is one transaction).

    Raises:
        RuntimeError: the writer lost rows (nothing may be dropped on a healthy database).
    """
    writer = WriterProcess(url, WriterOptions(child_niceness=niceness))
    writer.start_run(RunInfo(model="visibility", num_blocks=4096, block_size=16, dtype="float32", device="cpu"))
    writer.flush()
    submitted: list[float] = []  # monotonic time just before each step's submit
    latencies: list[float] = []
    streaming_done = threading.Event()
    reader = db_engine(url)

    def read() -> None:
        give_up_at = None  # a minute after the stream ended: the rows that are missing then were lost
        while True:
            if streaming_done.wait(POLL_S):
                give_up_at = give_up_at or time.monotonic() + 60
                if len(latencies) >= len(submitted) or time.monotonic() > give_up_at:
                    return
            with reader.connect() as connection:
                newest = (connection.scalar(select(func.max(EVENTS.c.id))) or 0) // STEP_EVENTS - 1
            now = time.monotonic()
            while len(latencies) <= newest:
                latencies.append(now - submitted[len(latencies)])

    thread = threading.Thread(target=read, name="visibility-reader")
    rng = random.Random(4)
    thread.start()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step = len(submitted)
            events = step_events(step, rng)
            views = [stream_view(index, step) for index in range(STEP_VIEWS)]
            submitted.append(time.monotonic())
            writer.submit(events)
            writer.record_requests(views)
            time.sleep(STEP_S)  # the stream's pace, not a wait for anything
        writer.flush()  # then the reader finds every step
    finally:
        streaming_done.set()
        thread.join()
        writer.close()
        reader.dispose()
    stats = writer.stats()
    if stats.dropped or stats.written_events != STEP_EVENTS * len(submitted):
        raise RuntimeError(f"the writer lost rows: {stats}")
    return latencies
