"""The daemon thread that steps an engine hosted in-process (the console's own engine).

It is one of the engine's two drivers; the other is the engine process's loop (engine/engine_process.py),
which steps on its own thread between draining its inbox. This one waits on the engine's condition
(notified when a request is queued) and steps while there is work; commands from other threads take the
same lock, so they land between steps. It never touches Streamlit.

Invariants:
    * It steps only while the engine has work, and stops within one step of `stop()`.
    * A step that raises ends the thread, and `on_failure` hears the error (nothing dies silently).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # how long an idle thread waits for a notification before it looks again


class StepThread:
    """Runs `step` on a daemon thread whenever `has_work()`; started at construction."""

    def __init__(
        self,
        work: threading.Condition,
        step: Callable[[], object],
        has_work: Callable[[], bool],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        """`work` is the engine's condition (over its lock): `has_work` is read, and `stop` notifies, under it."""
        self._work = work
        self._step = step
        self._has_work = has_work
        self._on_failure = on_failure
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="prefix-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current step, and wait for the thread to end."""
        with self._work:
            self._stopping = True
            self._work.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._stopping and not self._has_work():
                    self._work.wait(timeout=IDLE_WAIT_S)
                if self._stopping:
                    return
            try:
                self._step()
            except Exception as exc:  # the loop must not die silently: record and stop stepping
                logger.exception("engine step failed; the background loop stops")
                self._on_failure(exc)
                return
