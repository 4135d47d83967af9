"""Connecting a running engine to the history: one run row, then every step's events and requests.

Duck-typed on the engine (no torch import here): it needs `config`, `namespace`, `loaded` (model_id,
device, weights_revision), `num_blocks` and `add_listener`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from storage.write.writer_types import HistoryWriter, RunInfo


def run_info(engine: Any, started_at: float | None = None) -> RunInfo:
    """What identifies this engine start in the history."""
    return RunInfo(
        model=engine.loaded.model_id,
        num_blocks=engine.num_blocks,
        block_size=engine.config.block_size,
        dtype=engine.config.dtype,
        device=str(engine.loaded.device),
        weights_revision=engine.loaded.weights_revision,
        namespace=engine.namespace.root_key(None).hex(),
        started_at=time.time() if started_at is None else started_at,
    )


def record_engine(engine: Any, writer: HistoryWriter) -> str:
    """Start a run for `engine` and persist everything it does from now on. Returns the run id.

    The listener only checks, encodes and queues on the engine's thread; the database work happens in
    the writer (a WriterProcess: in another process), so the engine's step time does not depend on it.
    """
    run_id = writer.start_run(run_info(engine))
    engine.add_listener(persistence_listener(writer))
    return run_id


def persistence_listener(writer: HistoryWriter) -> Callable[[list, list], None]:
    """An engine listener that queues every event and request view into the writer's current run.

    The engine hands its listeners `Event`s and `RequestView`s, the only types the writers accept.
    """

    def persist(events: list, views: list) -> None:
        if events:
            writer.submit(events)
        if views:
            writer.record_requests(views)

    return persist


class EngineHistory:
    """An engine's history in the database at `db_url`, opened inside the engine's own process.

    Built (and pickled) by the process that starts the engine, holding only the URL; the engine process
    calls `next_request_number` before it builds its engine, `open` once it is built (a run row, and a
    WriterProcess fed by the engine's listener), and `close` when it stops (the rows handed over are
    written first).
    """

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.writer: HistoryWriter | None = None  # once open (a WriterProcess)
        self.run_id: str | None = None

    def next_request_number(self) -> int:
        """Past every "req-N" in the history, so generated ids never repeat an earlier run's (0 when the
        history cannot be read: the writer reports why)."""
        from storage.db import db_engine
        from storage.read.queries import next_request_number

        db = db_engine(self.db_url)
        try:
            return next_request_number(db)
        except Exception:
            return 0
        finally:
            db.dispose()

    def open(self, engine: Any) -> str:
        """Start the writer process and a run for `engine`; returns the run id."""
        from storage.write.writer_process import WriterProcess

        self.writer = WriterProcess(self.db_url)
        self.run_id = record_engine(engine, self.writer)
        return self.run_id

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close(timeout_s=10)

