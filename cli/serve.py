"""`serve`: the OpenAI-compatible API alone (no console), on one engine, writing the console's history.

    python -m cli serve --model smollm2 --port 8000 --db sqlite:///data/history.sqlite

The engine takes the console's settings as flags (`--num-blocks`, `--block-size`, `--dtype`, `--device`,
`--attention`, as PREFIX_CONSOLE_*); the API is serving/api.py's, on 127.0.0.1 unless `--host` says
otherwise. With `--db URL` the run, its events and its requests are written there through a
`WriterProcess`, as the console writes them, so `python -m cli why --db URL --request ID` explains any
response's id. It runs until SIGINT or SIGTERM. Exit status: 0; 2 for an invalid option, a database URL
that cannot be used or an address that cannot be bound; 1 when history rows could not be written.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from cli.engine_options import add_engine_options, engine_config
from engine.core.config import EngineConfig

if TYPE_CHECKING:
    from serving.api import ApiLimits

NAME = "serve"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="serve the OpenAI-compatible API (completions, chat, tokenize, metrics)")
    add_engine_options(parser)
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--db", default=None, help="SQLAlchemy URL: write the history there, as the console does")
    parser.add_argument("--max-in-flight", type=int, default=64, help="unfinished requests before 429")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="larger bodies get 413")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; returns the exit status (see the module docstring)."""
    from serving.api import ApiLimits
    from serving.server import bind

    try:
        config = engine_config(args)
        limits = ApiLimits(max_body_bytes=args.max_body_bytes, max_in_flight=args.max_in_flight)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        sock = bind(args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    writer = None
    if args.db is not None:  # storage is imported only when the history is asked for
        from storage.db import DatabaseUrlError
        from storage.write.writer_process import WriterProcess

        try:
            writer = WriterProcess(args.db)  # before the model loads: a bad URL fails at once
        except DatabaseUrlError as exc:
            sock.close()
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        _serve(config, limits, sock, writer)
    finally:
        sock.close()
        if writer is not None:
            writer.close()  # the rows handed over so far are written, also after a failure
    stats = None if writer is None else writer.stats()
    if stats is not None and stats.dropped:
        print(f"error: {stats.dropped} history rows could not be written (last error: {stats.last_error})",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _serve(config: EngineConfig, limits: ApiLimits, sock: socket.socket, writer: Any) -> None:
    """Load the engine, start its run in `writer`'s history (a WriterProcess, or None), and serve on `sock`
    until a signal."""
    from engine.engine import Engine
    from serving.api import create_app
    from serving.server import uvicorn_server

    engine = Engine(config)
    engine.warm_up()
    run_id = None
    if writer is not None:
        from storage.write.recorder import record_engine

        run_id = record_engine(engine, writer)
    app = create_app(lambda: engine, limits)
    server = uvicorn_server(app)
    host, port = sock.getsockname()[:2]
    history = f"; history run {run_id}" if run_id is not None else ""
    print(f"serving {engine.loaded.model_id} on http://{host}:{port}/v1{history}", file=sys.stderr, flush=True)
    engine.start()
    # uvicorn handles SIGINT and SIGTERM while it runs, then raises the signal again under the handlers it
    # found: with these it returns here, and the engine and the history writer shut down cleanly.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    try:
        server.run(sockets=[sock])  # until SIGINT / SIGTERM
    finally:
        engine.stop()
        app.state.bindings.close()
