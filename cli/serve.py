"""`serve`: the engine server: the engine in its own process, the OpenAI-compatible API and the console's
`/engine/...` routes in front of it, writing the console's history.

    python -m cli serve --model smollm2 --port 8000 --db sqlite:///data/history.sqlite

The engine takes the console's settings as flags (`--num-blocks`, `--block-size`, `--dtype`, `--device`,
`--attention`, as PREFIX_CONSOLE_*) and steps in a process of its own (engine/engine_process.py); this
process serves serving/api.py's API over it, on 127.0.0.1 unless `--host` says otherwise, as soon as the
model is loaded. A console attaches with `make run ENGINE=http://127.0.0.1:8000` (or its Settings page).
With `--db URL` the engine process writes the run, its events and its requests there through a
`WriterProcess`, so `python -m cli why --db URL --request ID` explains any response's id. It runs until
SIGINT or SIGTERM. Exit status: 0; 2 for an invalid option, a database URL that cannot be used or an
address that cannot be bound; 1 when the engine could not start."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from typing import TYPE_CHECKING

from cli.engine_options import add_engine_options, engine_config
from cli.usage import open_database
from engine.core.config import EngineConfig

if TYPE_CHECKING:
    from serving.api import ApiLimits

NAME = "serve"
LIMITS = ("max_body_bytes", "max_in_flight")  # the ApiLimits fields the flags set; unset ones keep their defaults


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="serve the OpenAI-compatible API (completions, chat, tokenize, metrics)")
    add_engine_options(parser)
    # Defaults left unset (None) are the server's own (serving.server, serving.api.ApiLimits), read in `run`,
    # so `--help` loads no web framework.
    parser.add_argument("--host", default=None, help="address to bind (default: serving.server's, this machine only)")
    parser.add_argument("--port", type=int, default=None, help="default: serving.server's")
    parser.add_argument("--db", default=None, help="SQLAlchemy URL: write the history there, as the console does")
    parser.add_argument("--max-in-flight", type=int, default=None, help="unfinished requests before 429 (default: ApiLimits')")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="larger bodies get 413 (default: ApiLimits')")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; returns the exit status (see the module docstring)."""
    from serving.api import ApiLimits
    from serving.server import DEFAULT_HOST, DEFAULT_PORT, bind

    if args.db is not None:  # a bad URL fails at once, before the model loads
        from storage.db import db_engine

        open_database(db_engine, args.db).dispose()
    host = DEFAULT_HOST if args.host is None else args.host
    port = DEFAULT_PORT if args.port is None else args.port
    try:
        config = engine_config(args)
        limits = ApiLimits(**{name: getattr(args, name) for name in LIMITS if getattr(args, name) is not None})
        if not 0 <= port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {port}")
        sock = bind(host, port)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _serve(config, limits, sock, args.db)
    except RuntimeError as exc:  # the engine could not start (EngineGone): its own error
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close()
    return 0


def _serve(config: EngineConfig, limits: ApiLimits, sock: socket.socket, db_url: str | None) -> None:
    """Start the engine process (its history run in `db_url`, when given) and serve on `sock` until a signal."""
    from serving.api import create_app
    from serving.console_routes import EngineHolder
    from serving.engine_client import EngineClient
    from serving.server import uvicorn_server

    holder = EngineHolder(EngineClient.start(config, db_url=db_url), db_url)
    try:
        app = create_app(holder, limits)
        server = uvicorn_server(app)
        host, port = sock.getsockname()[:2]
        run_id = holder.current().info.run_id
        history = f"; history run {run_id}" if run_id is not None else ""
        print(f"serving {holder.current().model_name} on http://{host}:{port}/v1{history}", file=sys.stderr,
              flush=True)  # fmt: skip
        # uvicorn handles SIGINT and SIGTERM while it runs, then raises the signal again under the handlers it
        # found: with these it returns here, and the engine process and its history writer shut down cleanly.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: None)
        server.run(sockets=[sock])  # until SIGINT / SIGTERM
        app.state.bindings.close()
    finally:
        holder.close()
