"""A pod's sockets: the SUB socket with its connection monitor (`Link`), and one replay request (`replay_frames`).

The replay socket is a ROUTER that answers one request with many messages. A ZeroMQ REQ socket
accepts only the first reply to a request and drops the rest, so `replay_frames` speaks REQ's envelope
(an empty delimiter frame) over a DEALER socket, a fresh one per replay.

The monitor tells the link's states apart (`fleet.events.LinkState`): a connection made (CONNECTED), one
lost (DISCONNECTED), and attempts that fail because nothing listens (REFUSED: ZeroMQ schedules a retry
after each failed attempt, and also once right after a lost connection, so after a loss the second
scheduled retry is the first refusal).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from fleet.config import CollectorConfig
from fleet.decode import FeedError, FeedErrorKind, Frame, split_replay
from fleet.events import LinkState
from fleet.source import PodSource

logger = logging.getLogger(__name__)

_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class ReplayTimeout(Exception):
    """The server was silent for replay_idle_timeout_s during a replay."""


class Stopped(Exception):
    """The collector is stopping."""


class Link:
    """A pod's SUB socket, its monitor and their poller; tracks the connection's state."""

    def __init__(self, context: zmq.Context, source: PodSource, config: CollectorConfig, max_frame_bytes: int):
        self.sub = context.socket(zmq.SUB)
        self.monitor: zmq.Socket | None = None
        self.state = LinkState.CONNECTING  # as the monitor last said
        self._retries = 0  # retries scheduled since the last connect or disconnect
        try:
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.RCVHWM, config.receive_hwm)
            self.sub.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            self.sub.setsockopt(zmq.RECONNECT_IVL, config.reconnect_ivl_ms)
            self.sub.setsockopt(zmq.RECONNECT_IVL_MAX, config.reconnect_ivl_max_ms)
            self.sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            self.monitor = self.sub.get_monitor_socket(_MONITORED)
            self.sub.connect(source.endpoint)
        except zmq.ZMQError:
            self.close()  # an open socket would hold the collector's `term` for ever
            raise
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def read_monitor(self) -> list[LinkState]:
        """Take the monitor's pending events; the states the link went through, in order (changes only)."""
        changes: list[LinkState] = []
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return changes
            if event == zmq.EVENT_CONNECTED:
                state, self._retries = LinkState.CONNECTED, 0
            elif event == zmq.EVENT_DISCONNECTED:
                state, self._retries = LinkState.DISCONNECTED, 0
            else:  # a retry scheduled
                self._retries += 1
                refused = self.state is LinkState.REFUSED or self._retries >= (
                    2 if self.state is LinkState.DISCONNECTED else 1
                )
                state = LinkState.REFUSED if refused else self.state
            if state is not self.state or event != zmq.EVENT_CONNECT_RETRIED:
                changes.append(state)
            self.state = state

    def close(self) -> None:
        if self.monitor is not None:
            self.sub.disable_monitor()
            self.monitor.close(linger=0)
        self.sub.close(linger=0)


def replay_frames(
    context: zmq.Context,
    source: PodSource,
    start: int,
    config: CollectorConfig,
    should_stop: Callable[[], bool],
    on_error: Callable[[FeedError], None],
) -> Iterator[Frame]:
    """The replies to one replay request from `start`, until the end marker.

    Args:
        context: the collector's ZeroMQ context.
        source: the pod (its replay_endpoint is not None).
        start: the first sequence number asked for.
        config: the collector's bounds and timeouts.
        should_stop: polled while waiting; True stops the replay.
        on_error: called with each reply refused (the replay goes on).

    Raises:
        ReplayTimeout: the server was silent for replay_idle_timeout_s.
        Stopped: should_stop() said so.
    """
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.limits.max_payload_bytes)
        sock.connect(source.replay_endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        timeout_ms = int(config.replay_idle_timeout_s * 1000)
        step_ms = max(1, min(timeout_ms, int(config.poll_interval_s * 1000)))
        for _ in range(config.max_replay_batches):
            waited_ms = 0
            while not sock.poll(step_ms):
                if should_stop():
                    raise Stopped
                waited_ms += step_ms
                if waited_ms >= timeout_ms:
                    raise ReplayTimeout
            frames = sock.recv_multipart()
            if not frames or frames[0] != b"":
                on_error(FeedError(FeedErrorKind.BAD_FRAMES, "replay reply without its delimiter frame"))
                continue
            try:
                frame = split_replay(frames[1:])
            except FeedError as error:
                on_error(error)
                continue
            if frame.is_end_marker:
                return
            yield frame
        logger.warning("pod %s: replay cut after %d batches", source.name, config.max_replay_batches)
    finally:
        sock.close(linger=0)
