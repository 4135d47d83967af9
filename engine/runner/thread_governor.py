"""How many threads the CPU forward uses, chosen between steps from the machine's CPU pressure.

With OpenMP workers that spin briefly (engine/openmp.py), a forward on every core is fastest while the
machine is quiet and 2.5x slower than on one thread as soon as another task wants a core. The governor
reads the kernel's CPU pressure (time during which some runnable task waited for a CPU) while the
engine steps, never while it idles (another engine or a compile running then says nothing about the
forward), and moves the thread count one at a time once it has `WINDOW_S` of stepping to judge by:

    down    pressure above `PRESSURE` with more than one thread: one thread fewer.
    up      `hold_s` after the last move down, a window without pressure: one thread more (a try).

Measured on 2 cores (SmolLM2 steps, 0.25 s windows): 0.01-0.06 quiet, a rare window at 0.2; 0.40-0.47
beside one busy task at two threads; 0.01 at one thread. At fewer threads the pressure cannot say
whether more would fit (one thread and one busy task share two cores without waiting), so going up is
a try: a try that meets pressure within its first two windows doubles the hold (1 s up to 32 s), and
a drop after a try that survived starts again from 1 s. Under steady contention the engine spends at
most one window in 32 s at the count that does not fit.

A judgement made before the engine idled is stale: the task it yielded to may be gone. The first step
after at least `IDLE_RESET_S` without one runs on `max_threads`, with the hold back at `MIN_HOLD_S` and
an empty window, and judging starts afresh (issue 43: a request after a pause, what an operator's click
and most API traffic are, ran 0.63 s at the one thread a neighbour's earlier burst had left, 0.22 s on
two). Under steady contention that costs the first window after each pause at the count that does not fit.

Every change of count is logged at INFO (from, to, and the pressure or the idle gap that moved it), and
counted: `changes`, and `time_at_threads()`, the seconds of stepping at each count (exported on
`/metrics` and Settings).

A change of count can move fp32 results in the last bits, as a change of batch can: PyTorch's CPU flash
kernel with a mask rounds differently at one thread for 16-wide heads; SmolLM2's linears (every shape,
1-1,056 rows) and attention calls measured bit-identical at one and two threads.

Invariants: 1 <= threads <= max_threads; the count changes only at the start or the end of a step, on
the thread that runs the forward (OpenMP's thread count belongs to the calling thread); the seconds in
`time_at_threads()` add up to the stepping time, and their keys are 1..max_threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine.openmp import cpu_stall_us

logger = logging.getLogger(__name__)

WINDOW_S = 0.25  # seconds of stepping before any judgement
PRESSURE = 0.30  # share of the stepping time during which some task waited for a CPU
MIN_HOLD_S = 1.0
MAX_HOLD_S = 32.0
IDLE_RESET_S = 1.0  # a gap between steps at least this long makes the next step start afresh on max_threads


class ThreadGovernor:
    """Sets the forward's thread count between steps (see the module docstring)."""

    def __init__(
        self,
        max_threads: int,
        *,
        read_stall_us: Callable[[], int | None] = cpu_stall_us,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self.hold_s = MIN_HOLD_S
        self.changes = 0  # how many times the count moved
        self._read_stall_us, self._set_threads, self._clock = read_stall_us, set_threads, clock
        self._stepping_s = 0.0  # stepping time in the open window
        self._stalled_us = 0  # pressure counted during it
        self._lowered_at = clock()
        self._try_windows: int | None = None  # windows closed since the last try, while it can still fail
        self._last_step_end: float | None = None  # None before the first step
        self._time_at = {n: 0.0 for n in range(1, max_threads + 1)}  # stepping seconds at each count

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """A governor for a CPU forward on several threads where the kernel reports CPU pressure; else None."""
        if device.type != "cpu" or cpu_stall_us() is None or torch.get_num_threads() < 2:
            return None
        return cls(torch.get_num_threads())

    def time_at_threads(self) -> dict[int, float]:
        """Seconds of stepping at each thread count since the start, by count (1..max_threads): a copy,
        safe to read from another thread."""
        return dict(self._time_at)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Count the pressure during one step; at its end, judge the window if it is long enough. After an
        idle gap of at least IDLE_RESET_S the step first starts afresh on max_threads."""
        started = self._clock()
        if self._last_step_end is not None and started - self._last_step_end >= IDLE_RESET_S:
            self._start_afresh(started - self._last_step_end)
        stall = self._read_stall_us()
        threads = self.threads
        try:
            yield
        finally:
            ended, stall_after = self._clock(), self._read_stall_us()
            self._last_step_end = ended
            self._time_at[threads] += ended - started
            if stall is not None and stall_after is not None:
                self._stepping_s += ended - started
                self._stalled_us += stall_after - stall
                if self._stepping_s >= WINDOW_S:
                    self._judge(self._stalled_us / (self._stepping_s * 1e6), ended)
                    self._stepping_s, self._stalled_us = 0.0, 0

    def _start_afresh(self, idle_s: float) -> None:
        """Forget what was judged before an idle gap: every thread, the shortest hold, an empty window."""
        self.hold_s, self._try_windows = MIN_HOLD_S, None
        self._stepping_s, self._stalled_us = 0.0, 0
        if self.threads != self.max_threads:
            self._move(self.max_threads, f"idle {idle_s:.1f} s")

    def _judge(self, pressure: float, now: float) -> None:
        if pressure > PRESSURE and self.threads > 1:
            failed_try = self._try_windows is not None
            self.hold_s = min(self.hold_s * 2, MAX_HOLD_S) if failed_try else MIN_HOLD_S
            self._move(self.threads - 1, f"pressure {pressure:.2f}")
            self._lowered_at, self._try_windows = now, None
        elif pressure <= PRESSURE and self.threads < self.max_threads and now - self._lowered_at >= self.hold_s:
            self._move(self.threads + 1, f"pressure {pressure:.2f}")
            self._try_windows = 0
        elif self._try_windows is not None:
            self._try_windows += 1
            if self._try_windows >= 2:
                self._try_windows = None  # the try survived two windows

    def _move(self, threads: int, why: str) -> None:
        logger.info("forward threads %d -> %d (%s)", self.threads, threads, why)
        self.threads = threads
        self.changes += 1
        self._set_threads(threads)
