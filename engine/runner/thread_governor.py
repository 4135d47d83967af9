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

A change of count can move fp32 results in the last bits, as a change of batch can: PyTorch's CPU flash
kernel with a mask rounds differently at one thread for 16-wide heads; SmolLM2's linears (every shape,
1-1,056 rows) and attention calls measured bit-identical at one and two threads.

Invariants: 1 <= threads <= max_threads; the count changes only at the end of a step, on the thread
that runs the forward (OpenMP's thread count belongs to the calling thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine.openmp import cpu_stall_us

WINDOW_S = 0.25  # seconds of stepping before any judgement
PRESSURE = 0.30  # share of the stepping time during which some task waited for a CPU
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
        self._stepping_s = 0.0  # stepping time in the open window
        self._stalled_us = 0  # pressure counted during it
        self._lowered_at = clock()
        self._try_windows: int | None = None  # windows closed since the last try, while it can still fail

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """A governor for a CPU forward on several threads where the kernel reports CPU pressure; else None."""
        if device.type != "cpu" or cpu_stall_us() is None or torch.get_num_threads() < 2:
            return None
        return cls(torch.get_num_threads())

    @contextmanager
    def step(self) -> Iterator[None]:
        """Count the pressure during one step; at its end, judge the window if it is long enough."""
        started, stall = self._clock(), self._read_stall_us()
        try:
            yield
        finally:
            ended, stall_after = self._clock(), self._read_stall_us()
            if stall is not None and stall_after is not None:
                self._stepping_s += ended - started
                self._stalled_us += stall_after - stall
                if self._stepping_s >= WINDOW_S:
                    self._judge(self._stalled_us / (self._stepping_s * 1e6), ended)
                    self._stepping_s, self._stalled_us = 0.0, 0

    def _judge(self, pressure: float, now: float) -> None:
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
