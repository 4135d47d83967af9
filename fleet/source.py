"""A pod to watch: where its KV-event feed, replay socket and metrics are, and the text that names one.

    NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,metrics=http://HOST:PORT/metrics][,topic=TOPIC]

is one pod (`parse_pod`): `python -m cli fleet watch --pod ...` takes one per option, the console's
$PREFIX_CONSOLE_FLEET_PODS a list of them separated by whitespace or ";" (`parse_pods`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_TOPIC_BYTES = 256
MAX_IPC_PATH_BYTES = 107  # a Unix socket path, less its terminating NUL
MAX_POD_TEXT_CHARS = 2048  # one pod's text
MAX_PODS = 256  # pods in one list
_OPTIONS = {"replay": "replay_endpoint", "metrics": "metrics_url", "topic": "topic"}  # option -> PodSource field


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
    """Refuse what ZeroMQ's connect would refuse, or would take but never reach (a wildcard, no host)."""
    if not isinstance(endpoint, str) or not endpoint.startswith(_ZMQ_SCHEMES) or "*" in endpoint:
        raise ValueError(f"{what} {endpoint!r}: tcp://HOST:PORT, ipc://PATH or inproc://NAME (no wildcard)")
    scheme, address = endpoint.split("://", 1)
    if not address or any(char.isspace() for char in address):
        raise ValueError(f"{what} {endpoint!r}: an empty address or one with spaces")
    if scheme == "tcp":
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{what} {endpoint!r}: tcp://HOST:PORT with a host and a port in 1-65535")
    elif scheme == "ipc" and len(address.encode()) > MAX_IPC_PATH_BYTES:
        raise ValueError(f"{what} {endpoint!r}: an ipc path of at most {MAX_IPC_PATH_BYTES} bytes")


def parse_pod(text: str) -> PodSource:
    """The pod `NAME=ENDPOINT[,replay=ENDPOINT][,metrics=URL][,topic=TOPIC]` names.

    Raises:
        ValueError: another shape, an unknown or repeated option, or a value PodSource refuses; the
            message says which.
    """
    if len(text) > MAX_POD_TEXT_CHARS:
        raise ValueError(f"a pod is at most {MAX_POD_TEXT_CHARS} characters")
    name, equals, rest = text.strip().partition("=")
    if not equals or not rest:
        raise ValueError(f"{text!r}: expected NAME=tcp://HOST:PORT[,replay=...][,metrics=...][,topic=...]")
    endpoint, *options = rest.split(",")
    fields: dict[str, str] = {}
    for option in options:
        key, equals, value = option.partition("=")
        if not equals or key not in _OPTIONS:
            raise ValueError(f"{text!r}: unknown option {option!r} (replay=, metrics=, topic=)")
        if _OPTIONS[key] in fields:
            raise ValueError(f"{text!r}: {key}= given twice")
        fields[_OPTIONS[key]] = value
    return PodSource(name, endpoint, **fields)


def parse_pods(text: str) -> list[PodSource]:
    """Pods separated by whitespace or ";" (an empty text is no pod).

    Raises:
        ValueError: a pod `parse_pod` refuses, two pods of one name, or more than MAX_PODS.
    """
    pods = [parse_pod(part) for part in re.split(r"[\s;]+", text) if part]
    if len(pods) > MAX_PODS:
        raise ValueError(f"at most {MAX_PODS} pods, got {len(pods)}")
    names = [pod.name for pod in pods]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"pod names must be unique: {', '.join(repeated)} given twice")
    return pods
