"""Connecting a running engine to the history: one run row, then every step's events and requests.

Duck-typed on the engine (no torch import here): it needs `config`, `namespace`, `loaded`,
`num_blocks`, `runner.loaded.device` and `add_listener`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from storage.writer import EventWriter, RunInfo


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


def record_engine(engine: Any, writer: EventWriter) -> str:
    """Start a run for `engine` and persist everything it does from now on. Returns the run id.

    The listener only queues (the writer thread does the I/O), so the engine's step time does not
    depend on the database.
    """
    run_id = writer.start_run(run_info(engine))
    engine.add_listener(persistence_listener(writer))
    return run_id


def persistence_listener(writer: EventWriter) -> Callable[[list, list], None]:
    """An engine listener that queues every event and request view into the writer's current run."""

    def persist(events: list, views: list) -> None:
        if events:
            writer.submit(events)
        if views:
            writer.record_requests(views)

    return persist
