"""A pod to watch: where its KV-event feed, replay socket and metrics are."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_TOPIC_BYTES = 256


@dataclass(frozen=True)
class PodSource:
    """One server (one data-parallel rank of one) publishing KV events.

    The collector connects to these endpoints; it never binds. A server configured with
    `"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"` is watched as
    `PodSource("pod-a", "tcp://HOST:5557", "tcp://HOST:5558")`. vLLM offsets both ports by the
    data-parallel rank, so each rank is its own pod.
    """

    name: str  # unique in a fleet: letters, digits, ".", "_", ":", "-"; at most 64 characters
    endpoint: str  # the server's PUB socket, tcp://HOST:PORT (or ipc://, inproc://)
    replay_endpoint: str | None = None  # the server's replay ROUTER socket, if it has one
    topic: str = ""  # the server's topic; "" accepts every topic
    metrics_url: str | None = None  # the server's Prometheus endpoint, http(s)://HOST:PORT/metrics

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"pod name {self.name!r}: 1-64 of letters, digits, '.', '_', ':', '-'")
        _check_zmq(self.endpoint, "endpoint")
        if self.replay_endpoint is not None:
            _check_zmq(self.replay_endpoint, "replay_endpoint")
        if len(self.topic.encode()) > MAX_TOPIC_BYTES:
            raise ValueError(f"topic longer than {MAX_TOPIC_BYTES} bytes")
        if self.metrics_url is not None:
            parts = urlsplit(self.metrics_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"metrics_url {self.metrics_url!r}: an http(s) URL with a host")


def _check_zmq(endpoint: str, what: str) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith(_ZMQ_SCHEMES) or "*" in endpoint:
        raise ValueError(f"{what} {endpoint!r}: tcp://HOST:PORT, ipc://PATH or inproc://NAME (no wildcard)")
