"""One pod's subscriber: its SUB socket, its sequence state and its replays, on a thread of its own.

Per pod, the sequence numbers drive everything (`next_seq` is the one expected next):

    live seq == next_seq       apply it
    live seq  > next_seq       a gap: replay next_seq .. seq-1, then apply seq
    live seq  < next_seq       the same bytes as the batch applied under seq: a duplicate of a replayed
                               batch (dropped); other bytes: a restarted server: PodReset to the
                               sinks, replay 0 .. seq-1, apply seq

The subscriber keeps the crc32 of the last `DIGESTS_KEPT` batches it handed on (more than a server's
replay buffer holds, 10,000 by default in vLLM), so a duplicate is told from a restart by its bytes,
however long ago the replay that delivered it was. A live batch numbered below them all is a restart.

It asks the replay socket for everything from next_seq on (`_catch_up`): at start, after every new
connection of the SUB socket (what the server published before the connection, or before the
subscription reached it, is missed: a server that comes up after the collector, or comes back), and
when a feed has been quiet for `idle_replay_after_s` after a message or a catch-up, since batches
dropped just before a server goes idle leave no gap to see until its next batch. A catch-up asks for
one batch more than it needs (next_seq - 1) when it can, and compares it with the batch applied under
that number: a different payload means the server restarted while the collector was away and its
numbers overtook the old ones; an empty answer means the server holds nothing numbered that high,
so it is a new process whose numbers are still below the old ones (the same server always keeps its
latest batch). Sequence numbers that neither live nor replay delivered are counted as lost
(`PodStats.num_lost_batches`): the index may then hold blocks the pod no longer has, or miss some.

A replay that goes silent for `replay_idle_timeout_s` is abandoned and counted; the next one waits for
a backoff that doubles up to `replay_backoff_max_s`. ZeroMQ itself reconnects a lost SUB connection;
ZeroMQ gives up after a protocol error, such as a frame over MAXMSGSIZE (set to twice
`DecodeLimits.max_payload_bytes`, so no larger frame is ever read into memory): a connection down for
`resubscribe_after_s` gets a new socket, and the wait doubles up to `resubscribe_max_s`. The link's
state goes to the sinks as a `PodStatus` when it changes and every `status_every_s`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable
from contextlib import closing
from dataclasses import replace

import zmq

from fleet.config import CollectorConfig
from fleet.decode import BatchDecoder, FeedError, Frame, split_live
from fleet.events import BatchOrigin, LinkState, PodBatch, PodReset, PodStatus, ResetReason
from fleet.link import Link, ReplayTimeout, Stopped, replay_frames
from fleet.pod_stats import PodStats
from fleet.source import PodSource

logger = logging.getLogger(__name__)

DIGESTS_KEPT = 16_384  # crc32 of the latest batches handed on, by seq (vLLM buffers 10,000 for replay)
_MAX_MESSAGES_PER_WAKE = 1_000  # then the thread looks at its monitor and the stop flag again
_FIRST_CONNECT_WAIT_S = 1.0  # at start, how long the first catch-up waits for the SUB socket to connect


class PodSubscriber:
    """One pod's SUB socket, sequence state and replays. `run` is its thread."""

    def __init__(
        self,
        source: PodSource,
        config: CollectorConfig,
        context: zmq.Context,
        emit: Callable[[object, int], None],
        stop: threading.Event,
    ) -> None:
        """Args:
        source: the pod.
        config: how to listen.
        context: the collector's ZeroMQ context.
        emit: queues a record for the sinks (raises queue.Full when there is no room yet).
        stop: set when the collector stops.
        """
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
        self._digests: dict[int, int] = {}  # seq -> crc32 of the payload handed on (the latest DIGESTS_KEPT)
        self._replay_backoff_s = config.replay_backoff_s
        self._no_replay_before = 0.0  # monotonic time the backoff ends
        self._quiet_since = 0.0  # monotonic time of the latest live message or catch-up
        self._tail_unchecked = False  # whether the quiet-feed check is armed
        self._catch_up_due = True  # a catch-up is owed: at start, and after every new connection
        self._down_since: float | None = None  # monotonic time the SUB connection was lost, if it is
        self._resubscribe_after_s = config.resubscribe_after_s
        self._status_due_at = 0.0  # monotonic time of the next PodStatus heartbeat

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
        link = Link(self._context, self.source, config, self._max_frame_bytes)
        timeout_ms = max(1, int(config.poll_interval_s * 1000))
        try:
            deadline = time.monotonic() + _FIRST_CONNECT_WAIT_S
            while link.state is LinkState.CONNECTING and time.monotonic() < deadline and not self._stop.is_set():
                if link.poller.poll(timeout_ms):
                    self._on_monitor(link)
            while not self._stop.is_set():
                if self._catch_up_due:
                    self._catch_up_due = False
                    self._catch_up()
                    with self._lock:
                        self._stats.ready = True
                if time.monotonic() >= self._status_due_at:
                    self._send_status(link.state)
                ready = dict(link.poller.poll(timeout_ms))
                if link.monitor in ready:
                    self._on_monitor(link)
                if self._down_since is not None and time.monotonic() - self._down_since > self._resubscribe_after_s:
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
        except Stopped:
            pass
        finally:
            link.close()

    def _resubscribe(self, link: Link) -> Link:
        """A new SUB socket for a connection ZeroMQ gave up on (it does not reconnect after a protocol
        error, such as a frame over MAXMSGSIZE); the wait for the next one doubles."""
        logger.warning("pod %s: down for %.1f s, new SUB socket", self.source.name, self._resubscribe_after_s)
        link.close()
        self._add(num_resubscribes=1)
        self._down_since = time.monotonic()
        self._resubscribe_after_s = min(2 * self._resubscribe_after_s, self.config.resubscribe_max_s)
        return Link(self._context, self.source, self.config, self._max_frame_bytes)

    def _on_monitor(self, link: Link) -> None:
        changes = link.read_monitor()
        for state in changes:
            with self._lock:
                self._stats.link = state
                if state is LinkState.CONNECTED:
                    self._stats.num_connects += 1
                elif state is LinkState.DISCONNECTED:
                    self._stats.num_disconnects += 1
            if state is LinkState.CONNECTED:
                self._down_since = None
                self._resubscribe_after_s = self.config.resubscribe_after_s
                self._catch_up_due = True  # what was published before the subscription arrived is missed
                # The server is back: replays that timed out while it was away do not delay this one.
                self._no_replay_before = 0.0
                self._replay_backoff_s = self.config.replay_backoff_s
            elif state is LinkState.DISCONNECTED:
                self._down_since = time.monotonic()
        if changes:
            self._send_status(link.state)

    def _send_status(self, link: LinkState) -> None:
        with self._lock:
            status = PodStatus(
                self.source.name, time.time(), link, self._stats.num_lost_batches, self._stats.num_restarts
            )
        self._put(status, 0)
        self._status_due_at = time.monotonic() + self.config.status_every_s

    # --- sequence handling --------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Ask the replay socket for everything from next_seq on, then arm the quiet-feed check.

        What the server sends while a subscription is on the way, or after the replay was served, is
        dropped with no later batch to show the gap: the quiet-feed check finds it.
        """
        if self.source.replay_endpoint is None:
            return
        self._recover(self._next_seq, None)
        self._quiet_since = time.monotonic()
        self._tail_unchecked = True

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
            if self._digests.get(seq) == zlib.crc32(frame.payload):
                self._add(num_duplicates=1)
                return
            self._restarted(seq)
            if seq > 0:
                self._recover(0, seq)
        self._deliver(frame, BatchOrigin.LIVE)

    def _restarted(self, revealing_seq: int) -> None:
        """The server is a new process: void the pod's state and expect its numbers from 0."""
        last_seq = self._next_seq - 1 if self._seen_any else None
        logger.warning("pod %s restarted (seq %s after %s)", self.source.name, revealing_seq, last_seq)
        with self._lock:
            self._stats.num_restarts += 1
            self._stats.last_restart_at = time.time()
        self._put(PodReset(self.source.name, ResetReason.RESTARTED, time.time(), last_seq, revealing_seq), 0)
        self._next_seq = 0
        self._seen_any = False
        self._digests.clear()

    def _recover(self, start: int, until: int | None) -> None:
        """Hand on batches start .. until-1 (until None: all the server buffers) from the replay socket."""
        if self.source.replay_endpoint is None or time.monotonic() < self._no_replay_before:
            self._add(num_replays_skipped=1)
            return
        digest = self._digests.get(start - 1) if start > 0 and start == self._next_seq else None
        self._add(num_replays=1)
        try:
            restarted = self._apply_replay(start, until, digest)
        except ReplayTimeout:
            logger.warning("pod %s: replay from %s timed out", self.source.name, start)
            self._add(num_replay_timeouts=1)
            self._no_replay_before = time.monotonic() + self._replay_backoff_s
            self._replay_backoff_s = min(2 * self._replay_backoff_s, self.config.replay_backoff_max_s)
            return
        self._replay_backoff_s = self.config.replay_backoff_s
        if restarted:
            self._restarted(start)
            self._recover(0, until)

    def _apply_replay(self, start: int, until: int | None, digest: int | None) -> bool:
        """Hand on the replayed batches from `start` (and below `until`).

        Args:
            start: the first sequence number wanted.
            until: the first one not wanted (it came live), or None for all.
            digest: the crc32 of the batch applied under start - 1, to verify against the server's
                (the replay then asks from start - 1); None: no verification.

        Returns:
            Whether the server is not the one whose batches were applied: its batch under start - 1
            differs, or it holds nothing numbered start - 1 or above.
        """
        verify = digest is not None
        should_stop = self._stop.is_set
        frames = replay_frames(
            self._context, self.source, start - 1 if verify else start, self.config, should_stop, self._count_error
        )
        answered = False
        with closing(frames) as replies:
            for frame in replies:
                answered = True
                with self._lock:
                    self._stats.last_received_at = time.time()
                if self._topic and frame.topic is not None and frame.topic != self._topic:
                    self._add(num_wrong_topic=1)
                    continue
                if verify:
                    verify = False  # only the first reply can be the one under start - 1
                    if frame.seq == start - 1:
                        if zlib.crc32(frame.payload) != digest:
                            return True
                        continue
                if frame.seq < self._next_seq:
                    continue
                if until is not None and frame.seq >= until:
                    break
                self._deliver(frame, BatchOrigin.REPLAY)
        return verify and not answered

    def _deliver(self, frame: Frame, origin: BatchOrigin) -> None:
        """Decode and hand on the batch under frame.seq (>= next_seq), counting the numbers skipped."""
        seq = frame.seq
        lost = seq - self._next_seq
        self._next_seq = seq + 1
        self._seen_any = True
        self._digests[seq] = zlib.crc32(frame.payload)
        if len(self._digests) > DIGESTS_KEPT:  # seqs only grow between resets: the first key is the oldest
            del self._digests[next(iter(self._digests))]
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
            Stopped: the collector is stopping.
        """
        while True:
            try:
                self._emit(record, payload_bytes)
                return
            except queue.Full:
                if self._stop.is_set():
                    raise Stopped from None
