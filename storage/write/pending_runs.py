"""The runs a history writer has not committed yet: a run row is never dropped.

A started run's row, and a run's stop time, stay pending until a transaction that carries them commits;
the writer puts everything pending into every write transaction (storage.write.batch.write_batch), so the
rows of a run always find their run. A stop time replaced while its transaction ran stays pending.

Not thread-safe: the writer guards it with its lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from storage.schema import RunEnd
from storage.write.batch import Stops
from storage.write.writer_types import RunInfo


class PendingRuns:
    """Run rows and stop times not yet committed, and the writer's current run."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}  # run id -> its row, not yet committed
        self.stops: Stops = {}  # run id -> (stopped_at, how it ended), not yet committed
        self.current: str | None = None  # the run new rows belong to

    def start(self, run_id: str, info: RunInfo) -> None:
        """A new run, which stops the current one (at the new one's start)."""
        if self.current is not None:
            self.stops[self.current] = (info.started_at, RunEnd.STOPPED)
        self.rows[run_id] = _run_row(run_id, info)
        self.current = run_id

    def restore(self, runs: Mapping[str, tuple[RunInfo, float | None]]) -> None:
        """Runs an earlier writer may not have committed: run id -> (info, stopped_at or None); the last
        is the current one."""
        for run_id, (info, stopped_at) in runs.items():
            self.rows[run_id] = _run_row(run_id, info)
            if stopped_at is not None:
                self.stops[run_id] = (stopped_at, RunEnd.STOPPED)
            self.current = run_id

    def stop_current(self, stopped_at: float, end: RunEnd) -> None:
        """End the current run (if any) at `stopped_at`."""
        if self.current is not None:
            self.stops[self.current] = (stopped_at, end)

    def committed(self, rows: Mapping[str, Any], stops: Stops) -> None:
        """A transaction carrying `rows` and `stops` (copies taken before it) committed."""
        for run_id in rows:
            self.rows.pop(run_id, None)
        for run_id, stop in stops.items():
            if self.stops.get(run_id) == stop:
                del self.stops[run_id]

    def __bool__(self) -> bool:
        return bool(self.rows or self.stops)


def _run_row(run_id: str, info: RunInfo) -> dict[str, Any]:
    """A new run's row; `heartbeat_at` is set when it is written."""
    return {"id": run_id, "stopped_at": None, "heartbeat_at": None, "end_reason": None, **asdict(info)}
