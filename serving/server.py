"""Serving the API with uvicorn on a background thread (the console, tests) or in the foreground (`cli serve`).

    server = ApiServer(EngineHolder(client, db_url), port=8000)   # bound when this returns (OSError if it cannot)
    server.url                                      # "http://127.0.0.1:8000"
    server.close()

The socket is bound here, before uvicorn starts, so a port in use fails at once with `OSError` instead of
inside uvicorn's thread. The host defaults to 127.0.0.1: serving other machines is a deliberate choice.
"""

from __future__ import annotations

import socket
import threading
import uvicorn
from fastapi import FastAPI

from serving.api import ApiLimits, create_app
from serving.console_routes import EngineHolder

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
STARTUP_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 takes any free one.

    Raises:
        OSError: the address cannot be bound (in use, not local).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_server(app: FastAPI) -> uvicorn.Server:
    """A uvicorn server for the API app (not started)."""
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


class ApiServer:
    """The API on a daemon thread, bound to (host, port) when constructed."""

    def __init__(
        self,
        holder: EngineHolder,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        limits: ApiLimits | None = None,
    ) -> None:
        """Bind and start serving.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: the server did not start within STARTUP_TIMEOUT_S.
        """
        self._socket = bind(host, port)
        self.host = host
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.holder = holder
        self._app = create_app(holder, limits)
        self._server = uvicorn_server(self._app)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="openai-api", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = threading.Event()
        waited = 0.0
        while not self._server.started and self._thread.is_alive() and waited < STARTUP_TIMEOUT_S:
            deadline.wait(0.02)
            waited += 0.02
        if not self._server.started:
            self.close()
            raise RuntimeError(f"the API server did not start on {self.url}")

    def close(self) -> None:
        """Stop serving (open streams are cut) and release the port; the engine process goes on (its
        holder's owner stops it). Safe to call twice."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._app.state.bindings.close()
        self._socket.close()
