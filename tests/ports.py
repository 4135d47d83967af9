"""Loopback ports for the servers and sockets the tests start."""

from __future__ import annotations

import socket
import threading

_handed_out: set[int] = set()  # every port this process was given: never given twice
_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and that this process was never given.

    The kernel may offer a port it offered a moment ago if nothing bound it yet; two calls in a row (a
    server's event port and its replay port) could then get the same one and the second bind fail.
    """
    with _lock:
        while True:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
