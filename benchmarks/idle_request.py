"""A request after a pause against the same request right after another (issue 43, the thread governor).

The SmolLM2 engine runs in this process on the calling thread (as `cli serve`'s engine thread steps it).
One request shape: a cached 1,024-token prefix, a fresh 16-token suffix, 8 new tokens. Each repeat
sleeps `--idle` seconds (5) plus a random fraction of a second (a whole number of seconds would start
every idle request at the same phase of the 1 s neighbour's cycle), times one request (idle), then at
once a second (after another). Timed
under four neighbours, one at a time:

    quiet       nothing else started by this script
    1s          a process that busy-loops 50 ms of every 1 s
    200ms       a process that busy-loops 50 ms of every 200 ms
    burst       two busy processes while three requests run just before the pause, stopped before it
                (the issue's case: the governor dropped to one thread during the burst, and the request
                after the pause found it there)

and under two governors, alternated repeat by repeat on the same engine: `now` (engine/runner/
thread_governor.py as it is: the first step after IDLE_RESET_S idle starts afresh on every thread) and
`before` (IDLE_RESET_S set to infinity: the judgement made before the pause stands, as before issue 43).

Printed: per neighbour and governor, the medians of both times, the ratio idle / after (the goal: within
1.10 on a quiet machine), and the share of the idle requests' stepping that ran on every thread. The machine's
own CPU pressure (avg10 of /proc/pressure/cpu) is printed at the start and end of each neighbour: other
work on a shared machine moves every number, so compare ratios within one run.

Run: `.venv/bin/python benchmarks/idle_request.py [--repeats 5] [--idle 5] [--only quiet --only burst]`
(about 4 minutes with the defaults).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 16
NEW_TOKENS = 8
NEIGHBOURS = {  # name -> (busy seconds, period seconds, processes); period 0: busy throughout
    "quiet": None,
    "1s": (0.05, 1.0, 1),
    "200ms": (0.05, 0.2, 1),
    "burst": (1.0, 0.0, 2),
}
NEIGHBOUR_CODE = """
import sys, time
busy, period = float(sys.argv[1]), float(sys.argv[2])
deadline = time.monotonic()
while True:
    start = time.monotonic()
    while time.monotonic() - start < busy or period == 0:
        pass
    deadline += period
    time.sleep(max(0.0, deadline - time.monotonic()))
"""


def pressure_avg10() -> str:
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "n/a"
    return next((part.split("=")[1] for part in first.split() if part.startswith("avg10=")), "n/a")


def start_neighbour(busy: float, period: float, processes: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", NEIGHBOUR_CODE, str(busy), str(period)]) for _ in range(processes)
    ]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="idle/after pairs per neighbour and governor")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of pause before the idle request")
    parser.add_argument("--only", choices=sorted(NEIGHBOURS), action="append", help="run only these neighbours")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engine.openmp import set_openmp_defaults

    openmp = set_openmp_defaults()  # before torch loads, as the console and the CLI do
    import engine.runner.thread_governor as governor_module
    from engine.core.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=args.model, num_blocks=args.num_blocks))
    engine.warm_up()
    governor = engine.thread_governor
    print(f"model {args.model}; OpenMP {openmp}; forward threads {engine.forward_threads()}; governor "
          f"{'none' if governor is None else f'max {governor.max_threads}'}; {os.cpu_count()} CPUs")  # fmt: skip
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    prefix = [rng.randrange(100, vocab) for _ in range(PREFIX_TOKENS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine.submit(prefix, params)  # caches the prefix's 64 blocks
    engine.run_until_idle()

    def timed_request() -> tuple[float, float]:
        """Seconds from submit to finish, and the share of its stepping on every thread."""
        suffix = [rng.randrange(100, vocab) for _ in range(SUFFIX_TOKENS)]
        at_before = governor.time_at_threads() if governor is not None else {}
        started = time.perf_counter()
        rid = engine.submit(prefix + suffix, params)
        engine.run_until_idle()
        elapsed = time.perf_counter() - started
        if engine.get(rid).cached_tokens < PREFIX_TOKENS:
            raise RuntimeError("the prefix was not a cache hit: raise --num-blocks")
        if governor is None:
            return elapsed, 1.0
        spent = {n: s - at_before[n] for n, s in governor.time_at_threads().items()}
        return elapsed, spent[governor.max_threads] / max(sum(spent.values()), 1e-9)

    default_reset = governor_module.IDLE_RESET_S
    governors = {"now": default_reset, "before": math.inf}
    rows = []
    for name in args.only or list(NEIGHBOURS):
        spec = NEIGHBOURS[name]
        print(f"\n[{name}] CPU pressure avg10 at start: {pressure_avg10()}", flush=True)
        background = start_neighbour(*spec) if spec is not None and spec[1] > 0 else []
        results = {g: {"idle": [], "after": [], "all_threads": []} for g in governors}
        try:
            for repeat in range(args.repeats):
                order = list(governors) if repeat % 2 == 0 else list(reversed(governors))
                for label in order:
                    governor_module.IDLE_RESET_S = governors[label]
                    if name == "burst":
                        burst = start_neighbour(*spec)
                        try:
                            for _ in range(3):
                                timed_request()
                        finally:
                            stop(burst)
                    time.sleep(args.idle + rng.random())  # a random phase against a periodic neighbour's bursts
                    idle, share = timed_request()
                    after, _ = timed_request()
                    r = results[label]
                    r["idle"].append(idle)
                    r["after"].append(after)
                    r["all_threads"].append(share)
                    print(f"  {label:6s} idle {idle:.3f} s ({share:.0%} of it on every thread), after {after:.3f} s",
                          flush=True)  # fmt: skip
        finally:
            stop(background)
            governor_module.IDLE_RESET_S = default_reset
        print(f"[{name}] CPU pressure avg10 at end: {pressure_avg10()}", flush=True)
        for label, r in results.items():
            idle, after = statistics.median(r["idle"]), statistics.median(r["after"])
            rows.append((name, label, idle, after, idle / after, statistics.mean(r["all_threads"])))

    print(f"\n{'neighbour':10s} {'governor':8s} {'idle s':>8s} {'after s':>8s} {'idle/after':>10s} {'idle on all threads':>20s}")
    for name, label, idle, after, ratio, share in rows:
        print(f"{name:10s} {label:8s} {idle:8.3f} {after:8.3f} {ratio:10.2f} {share:20.0%}")
    if governor is not None:
        seconds = governor.time_at_threads()
        print("governor:", governor.changes, "changes; seconds stepping at each count:",
              {n: round(s, 1) for n, s in seconds.items()})  # fmt: skip


if __name__ == "__main__":
    main()
