"""OpenMP's wait policy, chosen before torch loads, and the CPU pressure the engine reads between steps.

A step's forward runs a few hundred OpenMP parallel regions (the linears, the attention calls); between
two of them the worker threads wait. Measured on 2 cores with SmolLM2 (8 requests decoding 64 tokens
over a 1,024-token prefix, fp32):

    machine        threads sleep (OMP_WAIT_POLICY=PASSIVE)   spin ~0.1 ms (GOMP_SPINCOUNT=10000)   1 thread
    quiet          5.5-6.3 s                                  4.1-4.5 s                             -
    one busy task  6.4-6.7 s                                  15.4-15.8 s                           5.6-5.9 s

A sleeping worker takes 50-100 us to wake at every region, so spinning is 25-35 % faster on a quiet
machine; but a spinning thread stops looking like a sleeper to the kernel's scheduler, and as soon as
another task wants a core the step waits whole time slices (2.5x slower). One thread has no barrier to
wait at and beats both under contention. So the engine's workers spin briefly (`set_openmp_defaults`,
where the kernel reports CPU pressure) and the runner's thread governor (engine/runner/thread_governor.py)
drops threads while its own threads wait for a CPU (`threads_waited_us`). Where the kernel does not report pressure,
the workers sleep (PASSIVE), as before.

Two native caches keep one entry per distinct shape, and a server sees a new shape at nearly every prefill
length. oneDNN (the linears above the panel kernel's rows, ATen's CPU kernels) caches one compiled
primitive per shape (1,024 by default, ONEDNN_PRIMITIVE_CACHE_CAPACITY); ideep, torch's C++ layer over it,
caches one whole computation per shape in front of that (1,024 by default, LRU_CACHE_CAPACITY), each
holding its primitive, its scratch and its reordered buffers. Measured, tiny-llama in-process, one request
per prompt length: 200 new lengths grew the C heap by 61 MB at ideep's default and by 0.7 MB at 128; the
API soak (tiny-chat, 20,000 requests) grew by 181 MB with only oneDNN's cache bounded, and the engine
process by 30-50 MB more between its 2,000th and 20,000th request with both at 128 (the caches still
filling), by 5 MB at 64. Both are bounded at NATIVE_CACHE_CAPACITY entries unless the operator sized
them; a shape that left a cache is built again when it comes back (tens of microseconds, once per
weight shape in a step, beside the step's milliseconds).

Stdlib only: the console and the CLI call `set_openmp_defaults` before anything imports torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

CPU_PRESSURE = Path("/proc/pressure/cpu")  # Linux pressure stall information (kernel 4.20+, CONFIG_PSI)
OWN_TASKS = Path("/proc/self/task")  # this process's threads, each with its scheduler statistics
OPENMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what an operator (or a benchmark) sets itself
SPIN_COUNT = 10_000  # libgomp spins before sleeping: about 0.1 ms (its documentation: ~100,000 spins a ms)
NATIVE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's primitives, ideep's computations
NATIVE_CACHE_CAPACITY = 64  # entries each keeps (their default, 1,024 each, let a server grow for hours)


def cpu_stall_us(path: Path = CPU_PRESSURE) -> int | None:
    """Microseconds since boot during which at least one runnable task waited for a CPU (the "some"
    line's total), or None where the kernel does not report CPU pressure."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                name, _, value = field.partition("=")
                if name == "total" and value.isdigit():
                    return int(value)
    return None


def threads_waited_us(tasks: Path = OWN_TASKS) -> int | None:
    """Microseconds this process's threads have spent runnable but waiting for a CPU, summed over its
    threads (the second field of each `/proc/self/task/<tid>/schedstat`), or None where the kernel does
    not keep it (CONFIG_SCHED_INFO). A thread that ended takes its share with it: compare two readings
    over an interval in which the threads stay."""
    total_ns = 0
    try:
        for task in tasks.iterdir():
            try:
                total_ns += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the thread ended between the listing and the read
    except OSError:
        return None
    return total_ns // 1000 if total_ns else None


def set_openmp_defaults(environ: MutableMapping[str, str] = os.environ, path: Path = CPU_PRESSURE) -> str:
    """Choose how OpenMP workers wait, unless the operator already did (OMP_WAIT_POLICY or GOMP_SPINCOUNT).

    Also bounds oneDNN's and ideep's per-shape caches (NATIVE_CACHES, each unless the operator set it).
    Must run before torch loads (libgomp, oneDNN and ideep read their environment once). Returns the OpenMP
    setting in force, as "NAME=value" ("operator" when the operator's own setting stands).
    """
    for cache in NATIVE_CACHES:
        environ.setdefault(cache, str(NATIVE_CACHE_CAPACITY))
    if any(name in environ for name in OPENMP_SETTINGS):
        return "operator"
    if cpu_stall_us(path) is None:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        return "OMP_WAIT_POLICY=PASSIVE"
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return f"GOMP_SPINCOUNT={SPIN_COUNT}"
