"""The history writer's vocabulary, shared by the engine side and the writer process: its contract
(`HistoryWriter`), what identifies a run, how the writer buffers, batches, retries and prunes, and what
it reports."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from sqlalchemy import Connection

from engine.core.events import Event
from engine.core.snapshot import RequestView
from storage.db import DEFAULT_BUSY_TIMEOUT_MS
from storage.write.retention import RetentionPolicy
from storage.write.run_liveness import this_host

# A producer's bulk function: writes the row sets of its items (in submission order) on the batch's
# connection. A WriterProcess sends it to its child by name: a module-level function.
RowWriter = Callable[[Connection, list[Any]], None]


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
    # The process that owns the run, where this RunInfo was made (storage.write.run_liveness).
    host: str = field(default_factory=this_host)
    pid: int = field(default_factory=os.getpid)


@dataclass(frozen=True)
class WriterOptions:
    """How the writer buffers, batches, retries and prunes."""

    queue_items: int = 2048  # bound on the items handed over and not yet written or dropped (one item = one
    #   submit chunk, one request call or one producer's row set)
    item_rows: int = 512  # most events per item; a submit() of at most this many is atomic
    batch_rows: int = 5000  # rows gathered into one transaction (whole items; may exceed by one item)
    batch_interval_s: float = 0.5  # a batch waits this long after its first item for more (wait cuts it)
    retry_for_s: float = 120.0  # a batch failing with transient errors is retried this long, then dropped
    first_backoff_s: float = 0.05  # wait after the first failure; doubles per failure
    max_backoff_s: float = 2.0  # cap on that wait
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS  # per statement wait for another writer's lock
    prune_interval_s: float = 60.0  # retention runs this often (and once right after start)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    poll_s: float = 0.2  # idle wake-up period of the writer thread
    child_niceness: int = 0  # the writer process runs at this nice value (see storage.write.writer_process)


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
    written_other: int = 0  # rows handed in through `submit_rows` (the fleet's), as their producers count them
    lag_s: float = 0.0  # age of the oldest row handed over and not yet written or dropped (0: none)
    done_mark: int = 0  # every row handed over before `mark()` returned at most this is written or dropped
    restarts: int = 0  # writer processes started again after one exited unexpectedly (WriterProcess)


def new_run_id(started_at: float) -> str:
    """A readable, sortable, unique-enough run id: UTC start time plus 24 random bits."""
    stamp = datetime.fromtimestamp(started_at, tz=UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{secrets.token_hex(3)}"



@runtime_checkable
class HistoryWriter(Protocol):
    """The one contract of the history writer, kept by `storage.write.writer.EventWriter` (in-process: tests
    and tools) and `storage.write.writer_process.WriterProcess` (the product's: the database work in a child).

    * `start_run`, `submit`, `record_requests` and `submit_rows` never wait on the database. They check
      what they are given (engine `Event`s and `RequestView`s only: anything else raises TypeError at the
      call, see storage.write.rows), encode events and hand the call over as one message
      (storage.write.handover). At most `queue_items` messages are in flight; beyond that the newest rows
      are refused and counted in `stats().dropped`.
    * A `submit()` of at most `item_rows` events is written in one transaction, with the `evictions` rows
      of its EVICT events: a crash loses whole calls, never part of one. Longer calls are split into
      items of that size, each atomic.
    * Other producers (the fleet collector's sink, storage.write.fleet_sink) hand in their own rows with
      `submit_rows(rows, num_rows, write)`: the same bound, batches, retries and counters, their rows
      written by their own bulk function `write(connection, [rows, ...])` in the batch's transaction.
      Unlike the engine, such a producer may wait for room (`wait=True`) instead of dropping.
    * Read-your-writes: `mark()` names everything handed over so far; `wait(mark, timeout_s)` hurries
      those rows and returns once they are written or dropped; `flush` is `wait(mark())`.
    * Exact counts: written + queued + dropped == handed over, every row counted once. `stats().lag_s`
      is the age of the oldest row not yet written or dropped, `done_mark` the newest mark reached.
    * A run row is never dropped (storage.write.pending_runs). A new run's row names its owner (host,
      pid); the writer refreshes its heartbeat and closes the runs of dead owners as interrupted
      (storage.write.run_liveness).
    * `close` stops the current run and writes what was handed over; rows handed over after it are
      refused and counted.
    """

    def start_run(self, info: RunInfo) -> str: ...

    def submit(self, events: Sequence[Event]) -> None: ...

    def record_requests(self, views: Iterable[RequestView]) -> None: ...

    def submit_rows(self, rows: Any, num_rows: int, write: RowWriter, *, wait: bool = False) -> bool: ...

    def stats(self) -> WriterStats: ...

    def mark(self) -> int: ...

    def wait(self, mark: int, timeout_s: float | None = None) -> bool: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def close(self, timeout_s: float | None = 30.0) -> bool: ...
