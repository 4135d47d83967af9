"""How many threads the CPU forward uses, chosen between steps from the machine's CPU pressure.

With OpenMP workers that spin briefly (engine/openmp.py), a forward on every core is fastest while the
machine is quiet and 2.5x slower than on one thread as soon as another task wants a core. The governor
reads how long the engine's own threads waited for a CPU while it steps (`waited_per_thread_us`: the
scheduler's run delay of this process's threads, per forward thread), never while it idles, and moves
the thread count one at a time once it has `WINDOW_S` of stepping to judge by:

    down    pressure above `PRESSURE` in `DOWN_WINDOWS` windows in a row, with more than one thread:
            one thread fewer.
    up      `hold_s` after the last move down, a window without pressure: one thread more (a try).

Its own threads, not the machine's pressure (Linux PSI "some": any task waiting), because a server's
own API process and its clients wait for the engine's cores too, and that is no reason to give one up.
Measured on 2 cores serving SmolLM2 to 32 openai clients (the API process and the clients beside it),
1 s windows at a fixed two threads: the engine's threads waited 0.08 of the time per thread at the
median (p90 0.22), and 0.45 (p10 0.40) with a process busy on one core beside them; the machine's PSI
read 0.10 (p90 0.29) and 0.48. Judged by PSI, the governor spent 19.5 of 74 s of that serving on one
thread and the 32-client TTFT p50 was 4.1 s, against 2.3-3.0 s at a fixed two threads (vLLM's CPU
build: 2.7-3.2 s). In 0.25 s windows the serving alone put 3 of 90 windows above 0.40 and never two in a
row; beside the busy process 85 of 89 were, 81 times two in a row: hence two windows in a row above 0.40.

At fewer threads the wait cannot say whether more would fit (one thread and one busy task share two
cores without waiting), so going up is a try: a try given up within its first three windows doubles
the hold (1 s up to 32 s), and a drop after a try that survived starts again from 1 s. Under steady
contention the engine spends at most two windows in 32 s at the count that does not fit.

A judgement made before the engine idled is stale: the task it yielded to may be gone. The first step
after at least `IDLE_RESET_S` without one runs on `max_threads`, with the hold back at `MIN_HOLD_S` and
an empty window, and judging starts afresh (issue 43: a request after a pause, what an operator's click
and most API traffic are, ran 0.63 s at the one thread a neighbour's earlier burst had left, 0.22 s on
two). Under steady contention that costs the first two windows after each pause at the count that does not fit.

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

from engine.openmp import threads_waited_us

logger = logging.getLogger(__name__)

WINDOW_S = 0.25  # seconds of stepping before any judgement
PRESSURE = 0.40  # share of the stepping time during which the engine's threads waited for a CPU, per thread
DOWN_WINDOWS = 2  # windows in a row above PRESSURE before a thread is given up (a client's burst is one)


def waited_per_thread_us() -> int | None:
    """Microseconds this process's threads have waited for a CPU (engine/openmp.py's `threads_waited_us`)
    divided by the forward's thread count: comparable across counts, since the count only changes between
    two windows. None where the kernel does not keep it."""
    waited = threads_waited_us()
    return None if waited is None else waited // torch.get_num_threads()
MIN_HOLD_S = 1.0
MAX_HOLD_S = 32.0
IDLE_RESET_S = 1.0  # a gap between steps at least this long makes the next step start afresh on max_threads


class ThreadGovernor:
    """Sets the forward's thread count between steps (see the module docstring)."""

    def __init__(
        self,
        max_threads: int,
        *,
        read_stall_us: Callable[[], int | None] = waited_per_thread_us,
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
        self._windows_over = 0  # windows in a row above PRESSURE at the current count
        self._last_step_end: float | None = None  # None before the first step
        self._time_at = {n: 0.0 for n in range(1, max_threads + 1)}  # stepping seconds at each count

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """A governor for a CPU forward on several threads where the kernel reports its threads' waits; else None."""
        if device.type != "cpu" or threads_waited_us() is None or torch.get_num_threads() < 2:
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
        self._stepping_s, self._stalled_us, self._windows_over = 0.0, 0, 0
        if self.threads != self.max_threads:
            self._move(self.max_threads, f"idle {idle_s:.1f} s")

    def _judge(self, pressure: float, now: float) -> None:
        self._windows_over = self._windows_over + 1 if pressure > PRESSURE else 0
        if self._windows_over >= DOWN_WINDOWS and self.threads > 1:
            failed_try = self._try_windows is not None
            self.hold_s = min(self.hold_s * 2, MAX_HOLD_S) if failed_try else MIN_HOLD_S
            self._move(self.threads - 1, f"pressure {pressure:.2f}")
            self._lowered_at, self._try_windows = now, None
        elif pressure <= PRESSURE and self.threads < self.max_threads and now - self._lowered_at >= self.hold_s:
            self._move(self.threads + 1, f"pressure {pressure:.2f}")
            self._try_windows = 0
        elif self._try_windows is not None:
            self._try_windows += 1
            if self._try_windows > DOWN_WINDOWS:
                self._try_windows = None  # the try survived: contention now is news, not the same

    def _move(self, threads: int, why: str) -> None:
        logger.info("forward threads %d -> %d (%s)", self.threads, threads, why)
        self.threads, self._windows_over = threads, 0
        self.changes += 1
        self._set_threads(threads)
