"""The collector: one subscriber per pod, a metrics poller, and one dispatcher to the sinks.

    pod "a" SUB -> thread a ─┐                                ┌─> FleetIndex       (fleet.index)
    pod "b" SUB -> thread b ─┼─> bounded queue -> dispatcher ─┼─> FleetStore      (storage.write.fleet_sink)
    /metrics    -> poller   ─┘                                └─> ...
     (decode, order, recover by replay: fleet.subscriber)   (calls every sink, in order)

Each pod thread (`fleet.subscriber.PodSubscriber`) owns its sockets and its sequence state; the
dispatcher thread is the only caller of the sinks (see `fleet.sinks`), so a sink needs no lock for the
collector's sake. The queue between them is bounded, in records (`queue_size`) and in the batches'
payload bytes (`max_queued_bytes`, so that servers sending large batches cannot make it hold
gigabytes): a slow sink stalls the pod threads, the servers' PUB sockets drop what their high-water
marks cannot hold, and the dropped batches come back through the replay socket as a gap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from fleet.config import CollectorConfig
from fleet.events import PodBatch, PodMetrics, PodReset, PodStatus
from fleet.pod_stats import PodStats
from fleet.scraper import MetricsPoller
from fleet.sinks import BatchSink
from fleet.source import PodSource
from fleet.subscriber import PodSubscriber

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _OpenPod:
    source: PodSource  # the pod
    at: float  # when the collector started watching it


class Collector:
    """Watches pods' KV-event feeds and hands their batches to sinks, in order, from one thread.

    Use as a context manager, or call `start` and `stop`.
    """

    def __init__(
        self,
        sources: Sequence[PodSource],
        sinks: Sequence[BatchSink],
        config: CollectorConfig | None = None,
    ) -> None:
        """Args:
        sources: the pods; names must be unique.
        sinks: what receives the batches, each in this order.
        config: CollectorConfig() if None.
        """
        names = [source.name for source in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"pod names must be unique: {names}")
        self.config = config or CollectorConfig()  # how the collector listens
        self.sources = tuple(sources)  # the pods watched
        self.sinks = tuple(sinks)  # what receives the batches
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._listening_done = threading.Event()  # set once the pod threads put nothing more
        self._queue: queue.Queue[tuple[object, int]] = queue.Queue(self.config.queue_size)  # (record, bytes)
        self._room = threading.Condition()  # the pod threads wait on it for room in the queue
        self._queued_bytes = 0  # payload bytes of the batches in the queue (guarded by _room)
        self._subscribers = [
            PodSubscriber(source, self.config, self._context, self._emit, self._stop) for source in self.sources
        ]
        self._poller = MetricsPoller(self.sources, self.config, self._emit, self._stop)
        self._threads: list[threading.Thread] = []
        self._dispatcher: threading.Thread | None = None
        self._sink_errors = 0
        self._lock = threading.Lock()
        self._closed = False

    def _emit(self, record: object, payload_bytes: int) -> None:
        """Queue `record` (a batch whose payload had `payload_bytes`) once there is room: fewer than
        `queue_size` records and at most `max_queued_bytes` of payloads with it, or an empty queue.

        Raises:
            queue.Full: no room within `poll_interval_s` (the caller looks at the stop flag and tries again).
        """
        limit = self.config.max_queued_bytes

        def room() -> bool:
            fits = self._queued_bytes == 0 or self._queued_bytes + payload_bytes <= limit
            return fits and not self._queue.full()

        with self._room:  # only the pod threads put, and only under this lock: the room checked stays
            if not self._room.wait_for(room, self.config.poll_interval_s):
                raise queue.Full
            self._queue.put_nowait((record, payload_bytes))
            self._queued_bytes += payload_bytes

    def start(self) -> None:
        """Open every pod in the sinks and start listening.

        Raises:
            RuntimeError: started before, or stopped.
        """
        if self._dispatcher is not None or self._closed:
            raise RuntimeError("a Collector starts once")
        now = time.time()
        for source in self.sources:
            self._queue.put((_OpenPod(source, now), 0))
        self._dispatcher = threading.Thread(target=self._dispatch, name="fleet-dispatch", daemon=True)
        self._dispatcher.start()
        for subscriber in self._subscribers:
            thread = threading.Thread(target=subscriber.run, name=f"fleet-{subscriber.source.name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._poller.urls:
            thread = threading.Thread(target=self._poller.run, name="fleet-metrics", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop listening, hand the sinks what is queued, close the sockets. Idempotent.

        Waits up to `timeout_s` for the pod threads to stop, then up to `timeout_s` for the dispatcher to
        hand the sinks every queued record.

        Returns:
            True if it did. False if a sink was still busy (a storage sink waiting on a database that
            takes no rows): the dispatcher goes on alone and ends once the queue is empty. The caller
            then releases what the sink waits on (closes its writer) and calls no sink meanwhile.
        """
        if not self._closed:
            self._closed = True
            self._stop.set()
            for thread in self._threads:
                thread.join(timeout_s)
            self._listening_done.set()
            if self._dispatcher is not None:
                self._dispatcher.join(timeout_s)
            if any(thread.is_alive() for thread in self._threads):
                logger.error("a collector thread did not stop within %s s; closing its sockets under it", timeout_s)
                self._context.destroy(linger=0)
            else:
                self._context.term()
        delivered = self._dispatcher is None or not self._dispatcher.is_alive()
        if not delivered:
            logger.error("the sinks did not take the %d queued records within %s s", self.num_queued, timeout_s)
        return delivered

    def __enter__(self) -> Collector:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stats(self) -> dict[str, PodStats]:
        """Each pod's counters, by name (copies)."""
        return {subscriber.source.name: subscriber.stats() for subscriber in self._subscribers}

    @property
    def num_sink_errors(self) -> int:
        """Records a sink raised on (logged; the collector went on)."""
        with self._lock:
            return self._sink_errors

    @property
    def num_queued(self) -> int:
        """Records waiting for the dispatcher (approximate)."""
        return self._queue.qsize()

    def _dispatch(self) -> None:
        while True:
            try:
                record, payload_bytes = self._queue.get(timeout=self.config.poll_interval_s)
            except queue.Empty:
                if self._listening_done.is_set():
                    return  # the pod threads have stopped and everything they queued was handed over
                continue
            with self._room:
                self._queued_bytes -= payload_bytes
                self._room.notify_all()
            for sink in self.sinks:
                try:
                    if isinstance(record, PodBatch):
                        sink.apply_batch(record)
                    elif isinstance(record, PodStatus):
                        sink.pod_status(record)
                    elif isinstance(record, PodMetrics):
                        sink.apply_metrics(record)
                    elif isinstance(record, PodReset):
                        sink.reset_pod(record)
                    elif isinstance(record, _OpenPod):
                        sink.open_pod(record.source, record.at)
                except Exception:
                    logger.exception("sink %r failed on %r", sink, type(record).__name__)
                    with self._lock:
                        self._sink_errors += 1
