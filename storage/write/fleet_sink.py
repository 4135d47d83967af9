"""The collector's storage sink: every pod's batches into the fleet tables, through the history writer.

    writer = WriterProcess(url)                                 # the history writer (storage.write.writer_process)
    store = FleetStore(writer)                                  # a fleet.sinks.BatchSink
    with Collector(sources, [index, store]):                    # the dispatcher calls the store
        ...
    store.close()                                               # the sources' closing time
    writer.close()

The store turns each call into one `FleetRows` (storage.write.fleet_rows) and hands it to the writer with
`submit_rows(..., wait=True)`: one atomic item per batch, batched into transactions, retried and counted
like the engine's rows. When the writer has `queue_items` items in flight the dispatcher waits (the collector's bounded
queue then stalls the pod threads, and what the servers drop meanwhile comes back by replay), so no
batch is dropped for lack of room; what the writer gives up after its retries is counted in its
`dropped` (and in `FleetStoreStats.rows_dropped`).

Each store has its own collector id (`new_run_id`): its sources are "<collector id>/<pod>", and it only
writes rows of those, so consoles and `python -m cli fleet watch` processes can share one database.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from fleet.events import PodBatch, PodMetrics, PodReset, PodStatus
from fleet.source import PodSource
from storage.write.fleet_bulk import write_fleet_rows
from storage.write.fleet_rows import FleetRowBuilder, FleetRows
from storage.write.writer_types import HistoryWriter, new_run_id


@dataclass(frozen=True)
class FleetStoreStats:
    """What the store handed to the writer."""

    collector_id: str  # the id its sources' rows carry
    num_units: int  # FleetRows handed to the writer (one per opened pod, batch, reset, status, scrape, close)
    num_rows: int  # rows in them
    num_block_events: int  # blocks stored plus blocks removed in the batches handed over
    num_dropped_units: int  # units the writer refused at once (it was closing)


class FleetStore:
    """A `fleet.sinks.BatchSink` that persists what the collector sees. Called from one thread."""

    def __init__(self, writer: HistoryWriter, collector_id: str | None = None) -> None:
        """Args:
        writer: the history writer (a WriterProcess; an in-process EventWriter in tests and tools).
        collector_id: this collector's id; a new one (storage.write.writer.new_run_id) if None.
        """
        self.writer = writer  # where the rows go
        self.collector_id = collector_id or new_run_id(time.time())  # names this collector's rows
        self._builder = FleetRowBuilder(self.collector_id)
        self._lock = threading.Lock()  # guards the counters against stats() readers
        self._num_units = 0
        self._num_rows = 0
        self._num_block_events = 0
        self._num_dropped_units = 0

    # --- the sink -----------------------------------------------------------------------------

    def open_pod(self, source: PodSource, at: float) -> None:
        self._submit(self._builder.open(source, at))

    def apply_batch(self, batch: PodBatch) -> None:
        self._submit(self._builder.batch(batch))

    def reset_pod(self, reset: PodReset) -> None:
        self._submit(self._builder.reset(reset))

    def pod_status(self, status: PodStatus) -> None:
        self._submit(self._builder.status(status))

    def apply_metrics(self, metrics: PodMetrics) -> None:
        self._submit(self._builder.metrics(metrics))

    # --- the rest -----------------------------------------------------------------------------

    def close(self, at: float | None = None) -> None:
        """Record every source's closing time (call once the collector has stopped)."""
        self._submit(self._builder.close(time.time() if at is None else at))

    def source_ids(self) -> dict[str, str]:
        """Each pod's fleet_sources id, by pod name."""
        return self._builder.source_ids()

    def stats(self) -> FleetStoreStats:
        with self._lock:
            return FleetStoreStats(
                collector_id=self.collector_id,
                num_units=self._num_units,
                num_rows=self._num_rows,
                num_block_events=self._num_block_events,
                num_dropped_units=self._num_dropped_units,
            )

    def _submit(self, rows: FleetRows) -> None:
        num_rows = rows.num_rows
        accepted = self.writer.submit_rows(rows, num_rows, write_fleet_rows, wait=True)
        with self._lock:
            self._num_units += 1
            self._num_rows += num_rows
            self._num_block_events += rows.num_block_events
            if not accepted:
                self._num_dropped_units += 1
