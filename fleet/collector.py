"""The collector: one subscriber per pod, recovery of lost batches, and one dispatcher to the sinks.

    pod "a" SUB -> thread a ─┐                                ┌─> FleetIndex       (fleet.index)
    pod "b" SUB -> thread b ─┼─> bounded queue -> dispatcher ─┼─> storage writer   (phase B)
    pod "c" SUB -> thread c ─┘                                └─> ...
            (decode, order, recover by replay)          (calls every sink, in order)

Each pod thread owns its sockets and its sequence state; the dispatcher thread is the only caller of
the sinks (see `fleet.sinks`), so a sink needs no lock for the collector's sake. The queue between them
is bounded, in records (`queue_size`) and in the batches' payload bytes (`max_queued_bytes`, so that
servers sending large batches cannot make it hold gigabytes): a slow sink stalls the pod threads, the
servers' PUB sockets drop what their high-water marks cannot hold, and the dropped batches come back
through the replay socket as a gap.

Per pod, the sequence numbers drive everything (`next_seq` is the one expected next):

    live seq == next_seq       apply it
    live seq  > next_seq       a gap: replay next_seq .. seq-1, then apply seq
    live seq  < next_seq       a duplicate of a replayed batch (right after the start-up replay), or
                               a restarted server: PodReset to the sinks, replay 0 .. seq-1, apply seq

At start the thread asks the replay socket for everything it still buffers, so a collector that joins
late still learns what the cache holds; it asks again from next_seq when a feed has been quiet for
`idle_replay_after_s` after a message, since batches dropped just before a server goes idle leave no
gap to see until its next batch. A replay asks for one batch more than it needs (next_seq - 1)
when it can and compares it with the batch applied under that number: a different payload means the
server restarted while the collector was away and its numbers overtook the old ones, which the
sequence alone cannot show. Sequence numbers that neither live nor replay delivered are counted as
lost (`PodStats.num_lost_batches`): the index may then hold blocks the pod no longer has, or miss some.

The replay socket is a ROUTER that answers one request with many messages. A ZeroMQ REQ socket
accepts only the first reply to a request and drops the rest, so the collector speaks REQ's envelope
(an empty delimiter frame) over a DEALER socket, a fresh one per replay. A replay that goes silent for
`replay_idle_timeout_s` is abandoned and counted; the next one waits for a backoff that doubles up to
`replay_backoff_max_s`. ZeroMQ itself reconnects a lost SUB connection, with the backoff set by
`reconnect_ivl_ms` / `reconnect_ivl_max_ms`; a socket monitor counts connects and disconnects. ZeroMQ
gives up after a protocol error, such as a frame over MAXMSGSIZE (set to twice
`DecodeLimits.max_payload_bytes`, so no larger frame is ever read into memory): a connection down for
`resubscribe_after_s` gets a new socket, and the wait doubles up to `resubscribe_max_s`.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace

import zmq
from zmq.utils.monitor import recv_monitor_message

from fleet.decode import BatchDecoder, DecodeLimits, FeedError, FeedErrorKind, Frame, split_live, split_replay
from fleet.events import BatchOrigin, PodBatch, PodReset, ResetReason
from fleet.sinks import BatchSink
from fleet.source import PodSource

logger = logging.getLogger(__name__)

_MAX_MESSAGES_PER_WAKE = 1_000  # then the thread looks at its monitor and the stop flag again


@dataclass(frozen=True)
class CollectorConfig:
    """How the collector listens; every field has a default that suits a local fleet."""

    limits: DecodeLimits = field(default_factory=DecodeLimits)  # bounds on each message
    replay_idle_timeout_s: float = 2.0  # a replay silent this long is abandoned
    replay_backoff_s: float = 1.0  # after an abandoned replay, none for this long (doubling)
    replay_backoff_max_s: float = 30.0  # the backoff's ceiling
    idle_replay_after_s: float = 5.0  # a feed quiet this long after a message is checked for a lost tail
    max_replay_batches: int = 1_000_000  # a replay is cut after this many batches
    reconnect_ivl_ms: int = 100  # ZeroMQ's first reconnect delay (ZMQ_RECONNECT_IVL)
    reconnect_ivl_max_ms: int = 5_000  # ZeroMQ's reconnect delay ceiling (ZMQ_RECONNECT_IVL_MAX)
    resubscribe_after_s: float = 10.0  # a SUB connection down this long gets a new socket (doubling)
    resubscribe_max_s: float = 300.0  # that wait's ceiling
    receive_hwm: int = 100_000  # messages the SUB socket buffers (ZMQ_RCVHWM)
    queue_size: int = 10_000  # batches between the pod threads and the dispatcher
    max_queued_bytes: int = 256 * 1024 * 1024  # their payloads' bytes, at most (a larger batch goes alone)
    poll_interval_s: float = 0.1  # how often idle threads look at the stop flag

    def __post_init__(self) -> None:
        positive = {
            "replay_idle_timeout_s": self.replay_idle_timeout_s,
            "replay_backoff_s": self.replay_backoff_s,
            "replay_backoff_max_s": self.replay_backoff_max_s,
            "idle_replay_after_s": self.idle_replay_after_s,
            "max_replay_batches": self.max_replay_batches,
            "reconnect_ivl_ms": self.reconnect_ivl_ms,
            "reconnect_ivl_max_ms": self.reconnect_ivl_max_ms,
            "resubscribe_after_s": self.resubscribe_after_s,
            "resubscribe_max_s": self.resubscribe_max_s,
            "receive_hwm": self.receive_hwm,
            "queue_size": self.queue_size,
            "max_queued_bytes": self.max_queued_bytes,
            "poll_interval_s": self.poll_interval_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"CollectorConfig.{name} must be positive, got {value!r}")
        if self.replay_backoff_max_s < self.replay_backoff_s:
            raise ValueError("replay_backoff_max_s must be at least replay_backoff_s")
        if self.resubscribe_max_s < self.resubscribe_after_s:
            raise ValueError("resubscribe_max_s must be at least resubscribe_after_s")


class LinkState(enum.Enum):
    """The SUB socket's TCP connection, as its monitor reports it."""

    CONNECTING = "connecting"  # not connected yet
    CONNECTED = "connected"  # connected
    DISCONNECTED = "disconnected"  # lost; ZeroMQ is reconnecting with backoff


@dataclass
class PodStats:
    """What one pod's subscriber has seen. `Collector.stats` returns copies."""

    pod: str  # the pod's name
    ready: bool = False  # the start-up replay is over (done, timed out, or none): live batches flow
    link: LinkState = LinkState.CONNECTING  # the SUB connection
    num_connects: int = 0  # TCP connections made (1 + reconnects)
    num_disconnects: int = 0  # TCP connections lost
    num_resubscribes: int = 0  # new SUB sockets for a connection ZeroMQ gave up on
    num_batches: int = 0  # batches handed to the sinks, live and replayed
    num_replayed_batches: int = 0  # of which came through the replay socket
    num_block_events: int = 0  # blocks stored plus blocks removed in them
    num_unknown_events: int = 0  # events of unknown types skipped
    num_duplicates: int = 0  # live batches already applied from a replay (dropped)
    num_wrong_topic: int = 0  # messages under another topic (dropped)
    num_gaps: int = 0  # times the live sequence skipped ahead
    num_lost_batches: int = 0  # sequence numbers neither live nor replay delivered
    num_replays: int = 0  # replay requests sent
    num_replay_timeouts: int = 0  # replays abandoned because the server went silent
    num_replays_skipped: int = 0  # gaps not replayed: no replay socket, or backing off
    num_restarts: int = 0  # restarted servers detected (each sent a PodReset)
    errors: dict[FeedErrorKind, int] = field(default_factory=dict)  # messages refused, by kind
    last_error: str | None = None  # the latest refusal's reason
    last_seq: int | None = None  # the sequence number of the latest batch handed on
    last_batch_ts: float | None = None  # publisher time of that batch
    last_received_at: float | None = None  # collector time of the latest message of any kind
    last_lag_s: float | None = None  # received_at - ts of the latest live batch

    @property
    def num_errors(self) -> int:
        """Messages refused, all kinds together."""
        return sum(self.errors.values())


@dataclass(frozen=True)
class _OpenPod:
    source: PodSource  # the pod
    at: float  # when the collector started watching it


class _ReplayTimeout(Exception):
    pass


class _Link:
    """A pod's SUB socket, its monitor and their poller."""

    def __init__(self, context: zmq.Context, source: PodSource, config: CollectorConfig, max_frame_bytes: int):
        self.sub = context.socket(zmq.SUB)
        self.monitor: zmq.Socket | None = None
        try:
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.RCVHWM, config.receive_hwm)
            self.sub.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            self.sub.setsockopt(zmq.RECONNECT_IVL, config.reconnect_ivl_ms)
            self.sub.setsockopt(zmq.RECONNECT_IVL_MAX, config.reconnect_ivl_max_ms)
            self.sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self.sub.connect(source.endpoint)
        except zmq.ZMQError:
            self.close()  # an open socket would hold the collector's `term` for ever
            raise
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def close(self) -> None:
        if self.monitor is not None:
            self.sub.disable_monitor()
            self.monitor.close(linger=0)
        self.sub.close(linger=0)


class _PodSubscriber:
    """One pod's SUB socket, sequence state and replays. Runs in its own thread."""

    def __init__(
        self,
        source: PodSource,
        config: CollectorConfig,
        context: zmq.Context,
        emit: Callable[[object, int], None],
        stop: threading.Event,
    ) -> None:
        self.source = source
        self.config = config
        self._context = context
        self._emit = emit
        self._stop = stop
        self._decoder = BatchDecoder(config.limits)
        self._topic = source.topic.encode()
        # ZeroMQ drops the connection on a larger frame before allocating it; up to this size a frame
        # arrives, and one over max_payload_bytes is refused and counted (TOO_LARGE).
        self._max_frame_bytes = 2 * config.limits.max_payload_bytes
        self._lock = threading.Lock()  # guards _stats against Collector.stats readers
        self._stats = PodStats(source.name)
        self._next_seq = 0  # the sequence number expected next
        self._seen_any = False  # whether a batch was handed on since start or reset
        self._last_digest: int | None = None  # crc32 of the payload under next_seq - 1
        self._overlap_through: int | None = None  # live seqs <= this were applied from the start-up replay
        self._replay_backoff_s = config.replay_backoff_s
        self._no_replay_before = 0.0  # monotonic time the backoff ends
        self._quiet_since = 0.0  # monotonic time of the latest live message
        self._down_since: float | None = None  # monotonic time the SUB connection was lost, if it is
        self._resubscribe_after_s = config.resubscribe_after_s
        self._tail_unchecked = False  # whether live messages came since the last catch-up

    def stats(self) -> PodStats:
        with self._lock:
            return replace(self._stats, errors=dict(self._stats.errors))

    def _add(self, **increments: int) -> None:
        """Add to PodStats counters, e.g. `_add(num_gaps=1)`."""
        with self._lock:
            for name, n in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def _count_error(self, error: FeedError) -> None:
        logger.warning("pod %s: %s", self.source.name, error)
        with self._lock:
            self._stats.errors[error.kind] = self._stats.errors.get(error.kind, 0) + 1
            self._stats.last_error = str(error)

    # --- the thread ---------------------------------------------------------------------------

    def run(self) -> None:
        config = self.config
        link = _Link(self._context, self.source, config, self._max_frame_bytes)
        try:
            if self.source.replay_endpoint is not None:
                self._catch_up()
                # What the server sends while its subscription is on the way is dropped with no later
                # batch to show the gap: a quiet start gets the same check as a quiet end.
                self._quiet_since = time.monotonic()
                self._tail_unchecked = True
            with self._lock:
                self._stats.ready = True
            timeout_ms = max(1, int(config.poll_interval_s * 1000))
            while not self._stop.is_set():
                ready = dict(link.poller.poll(timeout_ms))
                if link.monitor in ready:
                    self._on_monitor(link.monitor)
                if (
                    self._down_since is not None
                    and time.monotonic() - self._down_since > self._resubscribe_after_s
                ):
                    link = self._resubscribe(link)
                    continue
                quiet_s = time.monotonic() - self._quiet_since
                if not ready and self._tail_unchecked and quiet_s > config.idle_replay_after_s:
                    self._tail_unchecked = False
                    self._catch_up()
                if link.sub in ready:
                    for _ in range(_MAX_MESSAGES_PER_WAKE):
                        try:
                            frames = link.sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(frames)
                        if self._stop.is_set():
                            break
        except _Stopped:
            pass
        finally:
            link.close()

    def _resubscribe(self, link: _Link) -> _Link:
        """A new SUB socket for a connection ZeroMQ gave up on (it does not reconnect after a protocol
        error, such as a frame over MAXMSGSIZE); the wait for the next one doubles."""
        logger.warning("pod %s: down for %.1f s, new SUB socket", self.source.name, self._resubscribe_after_s)
        link.close()
        self._add(num_resubscribes=1)
        self._down_since = time.monotonic()
        self._resubscribe_after_s = min(2 * self._resubscribe_after_s, self.config.resubscribe_max_s)
        return _Link(self._context, self.source, self.config, self._max_frame_bytes)

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:
                if event["event"] == zmq.EVENT_CONNECTED:
                    self._stats.link = LinkState.CONNECTED
                    self._stats.num_connects += 1
                    self._down_since = None
                    self._resubscribe_after_s = self.config.resubscribe_after_s
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._stats.link = LinkState.DISCONNECTED
                    self._stats.num_disconnects += 1
                    self._down_since = time.monotonic()

    # --- sequence handling --------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Ask the replay socket for everything from next_seq on (at start, and when a feed goes quiet).

        A PUB socket that drops the last batches before a server goes idle leaves no gap to see until
        the next batch; asking when the feed has been quiet for `idle_replay_after_s` finds them.
        """
        if self.source.replay_endpoint is None:
            return
        self._recover(self._next_seq, None)
        if self._seen_any:
            self._overlap_through = self._next_seq - 1

    def _on_live(self, frames: list[bytes]) -> None:
        with self._lock:
            self._stats.last_received_at = time.time()
        self._quiet_since = time.monotonic()
        self._tail_unchecked = True
        try:
            frame = split_live(frames)
        except FeedError as error:
            self._count_error(error)
            return
        if self._topic and frame.topic != self._topic:
            self._add(num_wrong_topic=1)
            return
        seq = frame.seq
        if seq > self._next_seq:
            if self._seen_any:
                self._add(num_gaps=1)
            self._recover(self._next_seq, seq)
        elif seq < self._next_seq:
            if self._overlap_through is not None and seq <= self._overlap_through:
                self._add(num_duplicates=1)
                return
            self._restarted(seq)
            if seq > 0:
                self._recover(0, seq)
        self._overlap_through = None
        self._deliver(frame, BatchOrigin.LIVE)

    def _restarted(self, revealing_seq: int) -> None:
        """The server is a new process: void the pod's state and expect its numbers from 0."""
        last_seq = self._next_seq - 1 if self._seen_any else None
        logger.warning("pod %s restarted (seq %s after %s)", self.source.name, revealing_seq, last_seq)
        self._add(num_restarts=1)
        self._put(PodReset(self.source.name, ResetReason.RESTARTED, time.time(), last_seq, revealing_seq), 0)
        self._next_seq = 0
        self._seen_any = False
        self._last_digest = None
        self._overlap_through = None

    def _recover(self, start: int, until: int | None) -> None:
        """Hand on batches start .. until-1 (until None: all the server buffers) from the replay socket."""
        if self.source.replay_endpoint is None or time.monotonic() < self._no_replay_before:
            self._add(num_replays_skipped=1)
            return
        verify = start > 0 and start == self._next_seq and self._last_digest is not None
        self._add(num_replays=1)
        try:
            restarted = self._apply_replay(start, until, verify)
        except _ReplayTimeout:
            logger.warning("pod %s: replay from %s timed out", self.source.name, start)
            self._add(num_replay_timeouts=1)
            self._no_replay_before = time.monotonic() + self._replay_backoff_s
            self._replay_backoff_s = min(2 * self._replay_backoff_s, self.config.replay_backoff_max_s)
            return
        self._replay_backoff_s = self.config.replay_backoff_s
        if restarted:
            self._restarted(start)
            self._recover(0, until)

    def _apply_replay(self, start: int, until: int | None, verify: bool) -> bool:
        """Hand on the replayed batches from `start` (and below `until`).

        Args:
            start: the first sequence number wanted.
            until: the first one not wanted (it came live), or None for all.
            verify: ask from start - 1 and compare that batch with the one applied under it.

        Returns:
            Whether the batch under start - 1 differs from the one applied: a restarted server.
        """
        with closing(self._replay_frames(start - 1 if verify else start)) as replies:
            for frame in replies:
                if self._topic and frame.topic is not None and frame.topic != self._topic:
                    self._add(num_wrong_topic=1)
                    continue
                if verify:
                    verify = False  # only the first reply can be the one under start - 1
                    if frame.seq == start - 1:
                        if zlib.crc32(frame.payload) != self._last_digest:
                            return True
                        continue
                if frame.seq < self._next_seq:
                    continue
                if until is not None and frame.seq >= until:
                    break
                self._deliver(frame, BatchOrigin.REPLAY)
        return False

    def _replay_frames(self, start: int) -> Iterator[Frame]:
        """The replies to one replay request from `start`, until the end marker.

        Raises:
            _ReplayTimeout: the server was silent for replay_idle_timeout_s.
            _Stopped: the collector is stopping.
        """
        config = self.config
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
            sock.connect(self.source.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            timeout_ms = int(config.replay_idle_timeout_s * 1000)
            step_ms = max(1, min(timeout_ms, int(config.poll_interval_s * 1000)))
            for _ in range(config.max_replay_batches):
                waited_ms = 0
                while not sock.poll(step_ms):
                    if self._stop.is_set():
                        raise _Stopped
                    waited_ms += step_ms
                    if waited_ms >= timeout_ms:
                        raise _ReplayTimeout
                frames = sock.recv_multipart()
                with self._lock:
                    self._stats.last_received_at = time.time()
                if not frames or frames[0] != b"":
                    self._count_error(
                        FeedError(FeedErrorKind.BAD_FRAMES, "replay reply without its delimiter frame")
                    )
                    continue
                try:
                    frame = split_replay(frames[1:])
                except FeedError as error:
                    self._count_error(error)
                    continue
                if frame.is_end_marker:
                    return
                yield frame
            logger.warning("pod %s: replay cut after %d batches", self.source.name, config.max_replay_batches)
        finally:
            sock.close(linger=0)

    def _deliver(self, frame: Frame, origin: BatchOrigin) -> None:
        """Decode and hand on the batch under frame.seq (>= next_seq), counting the numbers skipped."""
        seq = frame.seq
        lost = seq - self._next_seq
        self._next_seq = seq + 1
        self._seen_any = True
        self._last_digest = zlib.crc32(frame.payload)
        if lost:
            self._add(num_lost_batches=lost)
        try:
            batch = self._decoder.decode(frame.payload)
        except FeedError as error:
            self._count_error(error)
            return
        received_at = time.time()
        pod_batch = PodBatch(self.source.name, seq, batch, received_at, origin)
        with self._lock:
            stats = self._stats
            stats.num_batches += 1
            stats.num_block_events += batch.num_block_events
            stats.num_unknown_events += len(batch.unknown_event_types)
            if origin is BatchOrigin.REPLAY:
                stats.num_replayed_batches += 1
            else:
                stats.last_lag_s = pod_batch.lag_s
            stats.last_seq = seq
            stats.last_batch_ts = batch.ts
        self._put(pod_batch, len(frame.payload))

    def _put(self, record: object, payload_bytes: int) -> None:
        """Queue a record for the dispatcher, waiting while the queue is full.

        Raises:
            _Stopped: the collector is stopping.
        """
        while True:
            try:
                self._emit(record, payload_bytes)
                return
            except queue.Full:
                if self._stop.is_set():
                    raise _Stopped from None


class _Stopped(Exception):
    pass


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
            _PodSubscriber(source, self.config, self._context, self._emit, self._stop) for source in self.sources
        ]
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
                logger.error("a pod thread did not stop within %s s; closing its sockets under it", timeout_s)
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
                    elif isinstance(record, PodReset):
                        sink.reset_pod(record)
                    elif isinstance(record, _OpenPod):
                        sink.open_pod(record.source, record.at)
                except Exception:
                    logger.exception("sink %r failed on %r", sink, type(record).__name__)
                    with self._lock:
                        self._sink_errors += 1
