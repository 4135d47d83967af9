"""The engine's KV-event feed on ZeroMQ, as vLLM 0.33's ZmqEventPublisher serves it.

    live    PUB socket at `endpoint`          [topic, seq (8 bytes big-endian), payload]
    replay  ROUTER socket at `replay_endpoint`  request [start seq (8 bytes big-endian)] from a REQ
            (or a DEALER speaking REQ's envelope); reply: every buffered batch with seq >= start as
            [topic, seq, payload], then the end marker [b"", seq -1, b""]

The payload is the msgpack of `engine.feeds.kv_events.EventBatch`. As an engine listener (`on_step`, on the
engine thread after every step) the publisher translates the step's events (`KVEventTranslator`) and,
when there are any, encodes the batch, gives it the next sequence number and appends it to the replay
buffer (the last `buffer_batches`, vLLM's `buffer_steps`) right there, so a batch is replayable the moment
it exists; then it queues it for the publisher thread, which owns both sockets. The engine thread never
waits: when the queue is full (the thread starved) the batch is not sent live and is counted
(`num_unsent`); subscribers see the gap and fetch it by replay. A PUB socket never blocks either: a slow
subscriber loses what its high-water mark cannot hold, and replays it.

Security: binds what the configuration names; give tcp://127.0.0.1:PORT unless other hosts must reach
it. Replay requests are bounded (one 8-byte frame) and malformed ones are counted and ignored.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from engine.core.events import Event
from engine.feeds.kv_events import DiskBlock, EventBatch, KVEventTranslator

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_BATCHES = 10_000  # vLLM's buffer_steps default
DEFAULT_HWM = 100_000  # vLLM's hwm default
_QUEUE_BATCHES = 10_000  # batches waiting for the publisher thread
_POLL_S = 0.05  # the publisher thread looks at its sockets and the stop flag this often


@dataclass(frozen=True)
class PublisherStats:
    """What the publisher did."""

    num_published: int  # batches given a sequence number (the next one is this)
    num_sent: int  # of which sent on the PUB socket
    num_unsent: int  # of which not sent live (the queue was full): replay only
    num_events: int  # KV events in the published batches
    num_replays: int  # replay requests answered
    num_bad_requests: int  # replay requests of another shape (ignored)
    endpoint: str  # the PUB socket's bound address
    replay_endpoint: str | None  # the ROUTER's bound address


class KVEventPublisher:
    """PUB + replay ROUTER sockets and the thread that serves them. Use `on_step` as an engine listener."""

    def __init__(
        self,
        translator: KVEventTranslator,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = DEFAULT_BUFFER_BATCHES,
    ) -> None:
        """Bind the sockets and start the thread.

        Args:
            translator: makes KV events from engine events.
            endpoint: where the PUB socket binds, e.g. "tcp://127.0.0.1:5557" (port 0: any free port).
            replay_endpoint: where the replay ROUTER binds; None for no replay.
            topic: the topic frame of every message.
            buffer_batches: how many of the latest batches a replay can return.

        Raises:
            ValueError: a bad buffer size.
            zmq.ZMQError: an endpoint that cannot be bound (in use, malformed); nothing stays open.
        """
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be positive, got {buffer_batches}")
        self.translator = translator  # engine events -> KV events
        self._topic = topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = self._context.socket(zmq.ROUTER) if replay_endpoint is not None else None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the bound address (port 0 resolved)
            self.replay_endpoint: str | None = None  # the replay ROUTER's bound address
            if self._replay is not None:
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_batches + 1))  # a whole replay and its marker
                self._replay.setsockopt(zmq.MAXMSGSIZE, 64)  # requests are 8 bytes: refuse anything large
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # guards the buffer and the counters
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.Queue[tuple[int, bytes]] = queue.Queue(_QUEUE_BATCHES)
        self._next_seq = 0
        self._counts = {"sent": 0, "unsent": 0, "events": 0, "replays": 0, "bad": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # --- the engine side ----------------------------------------------------------------------

    def on_step(self, events: list[Event], views: list) -> None:
        """The engine listener: publish the KV events of one step's events (nothing if there are none)."""
        kv_events = self.translator.translate(events)
        if kv_events:
            self.publish(EventBatch(ts=time.time(), events=kv_events, data_parallel_rank=0))

    def announce_disk(self, blocks: list[DiskBlock]) -> int | None:
        """Publish the blocks a restarted engine found in its disk tier (`kv_events.disk_blocks`) as one batch,
        before the engine steps (the translator is the engine thread's once it does).

        Returns:
            The batch's sequence number; None when there are no blocks.
        """
        if not blocks:
            return None
        events = self.translator.announce_disk(blocks)
        return self.publish(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def publish(self, batch: EventBatch) -> int:
        """Give `batch` the next sequence number, buffer it for replay and queue it to be sent.

        Returns:
            Its sequence number.
        """
        payload = self._encoder.encode(batch)
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            self._counts["events"] += len(batch.events)
            try:
                self._queue.put_nowait((seq, payload))
            except queue.Full:
                self._counts["unsent"] += 1
        return seq

    def stats(self) -> PublisherStats:
        with self._lock:
            counts = dict(self._counts)
            published = self._next_seq
        return PublisherStats(
            num_published=published,
            num_sent=counts["sent"],
            num_unsent=counts["unsent"],
            num_events=counts["events"],
            num_replays=counts["replays"],
            num_bad_requests=counts["bad"],
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (within `timeout_s`), stop the thread, close the sockets. Idempotent."""
        if self._stop.is_set():
            return
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + _POLL_S * 4)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    # --- the publisher thread -----------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is not None and poller.poll(0):
                self._answer_replay()
            try:
                seq, payload = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV-event publisher: sending batch %d failed", seq)
                continue
            with self._lock:
                self._counts["sent"] += 1

    def _answer_replay(self) -> None:
        try:
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            with self._lock:
                self._counts["bad"] += 1
            logger.warning("KV-event publisher: ignored a replay request of %d frames", len(frames))
            return
        identity, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            self._counts["replays"] += 1
        for seq, payload in batches:
            self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))
