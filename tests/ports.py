"""Loopback ports for the servers and sockets the tests start."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_handed_out: set[int] = set()  # every port this process was given: never given twice
_lock = threading.Lock()
_SPAN = 10_000  # how many ports below the kernel's ephemeral range are drawn from
_random = random.SystemRandom()  # not the global generator, which tests may seed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, below the kernel's ephemeral range, and
    that this process was never given.

    Below the ephemeral range, because the port is bound later, by the code under test, and the kernel
    hands out ephemeral ports meanwhile: to outgoing connections and to every bind to port 0 (a ZeroMQ
    wildcard endpoint such as vLLM's "tcp://127.0.0.1:*" among them). A port probed there and released
    was once handed straight back to the next wildcard bind, and the replay socket bound after it found
    its port taken. The kernel never picks a port below the range on its own.
    """
    low = _ephemeral_low()
    with _lock:
        while True:
            port = _random.randrange(max(1024, low - _SPAN), low)
            if port in _handed_out:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:  # bound by someone else: draw again
                    continue
            _handed_out.add(port)
            return port


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its usual value, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
