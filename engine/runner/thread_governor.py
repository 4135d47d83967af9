"""How many threads the CPU forward uses, chosen between steps from the machine's CPU pressure.

With OpenMP workers that spin briefly (engine/openmp.py), a forward on every core is fastest while the
machine is quiet and 2.5x slower than on one thread as soon as another task wants a core. The governor
reads the kernel's CPU pressure (time during which some runnable task waited for a CPU) over windows of
at least `WINDOW_S` and moves the thread count one at a time:

    down    a window with pressure above `PRESSURE` and more than one thread: one thread fewer.
    up      after `hold_s` at the lower count, a window without pressure: one thread more (a try).

At fewer threads the pressure cannot say whether more would fit (with one thread and one other busy
task, two tasks share two cores without waiting), so going up is a try: a try that meets pressure
within its first two windows doubles the hold (1 s up to 32 s); a drop after a try that survived
starts again from 1 s. Under steady contention the engine spends at most one window in 32 s at the
count that does not fit.

Invariants: 1 <= threads <= max_threads; the governor changes the thread count only in
`before_step`, on the thread that runs the forward (OpenMP's thread count is per calling thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.openmp import cpu_stall_us

WINDOW_S = 0.25  # seconds of evidence before any change
PRESSURE = 0.10  # share of a window during which some task waited for a CPU
MIN_HOLD_S = 1.0
MAX_HOLD_S = 32.0


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
        self.changes = 0  # how many times the count moved (reported by benchmarks)
        self._read_stall_us, self._set_threads, self._clock = read_stall_us, set_threads, clock
        self._window_start, self._stall_start = clock(), read_stall_us()
        self._lowered_at = self._window_start
        self._try_windows: int | None = None  # windows closed since the last try, while it can still fail

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """A governor for a CPU forward where the kernel reports CPU pressure; None otherwise."""
        if device.type != "cpu" or cpu_stall_us() is None or torch.get_num_threads() < 2:
            return None
        return cls(torch.get_num_threads())

    def before_step(self) -> None:
        """Close the window if it is long enough and move the thread count if it says so."""
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < WINDOW_S:
            return
        stall = self._read_stall_us()
        if stall is None or self._stall_start is None:
            return
        pressure = (stall - self._stall_start) / (elapsed * 1e6)
        self._window_start, self._stall_start = now, stall
        if pressure > PRESSURE and self.threads > 1:
            failed_try = self._try_windows is not None
            self.hold_s = min(self.hold_s * 2, MAX_HOLD_S) if failed_try else MIN_HOLD_S
            self._move(self.threads - 1)
            self._lowered_at, self._try_windows = now, None
        elif pressure <= PRESSURE and self.threads < self.max_threads and now - self._lowered_at >= self.hold_s:
            self._move(self.threads + 1)
            self._try_windows = 0
        elif self._try_windows is not None:
            self._try_windows += 1
            if self._try_windows >= 2:
                self._try_windows = None  # the try survived two windows

    def _move(self, threads: int) -> None:
        self.threads = threads
        self.changes += 1
        self._set_threads(threads)
