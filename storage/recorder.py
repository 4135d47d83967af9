"""Connecting a running engine to the history: one run row, then every step's events and requests.

Duck-typed on the engine (no torch import here): it needs `config`, `namespace`, `loaded`,
`num_blocks`, `runner.loaded.device` and `add_listener`.
"""

from __future__ import annotations

from typing import Any

from storage.writer import EventWriter, RunInfo


def record_engine(engine: Any, writer: EventWriter) -> str:
    """Start a run for `engine` and persist everything it does from now on. Returns the run id.

    The listener only queues (the writer thread does the I/O), so the engine's step time does not
    depend on the database.
    """
    config = engine.config
    run_id = writer.start_run(
        RunInfo(
            model=config.model,
            num_blocks=engine.num_blocks,
            block_size=config.block_size,
            dtype=config.dtype,
            device=str(engine.loaded.device),
            weights_revision=engine.loaded.weights_revision,
            namespace=engine.namespace.root_key().hex(),
        )
    )

    def persist(events: list, views: list) -> None:
        if events:
            writer.submit(events)
        if views:
            writer.record_requests(views)

    engine.add_listener(persist)
    return run_id
