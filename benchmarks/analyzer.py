"""Workload analyzer: speed and policy quality on the Mooncake traces, side by side in one run.

  1. The LRU curve of the conversation trace at 512-token blocks, at 100 capacities log-spaced from one
     block to the trace's unique blocks: the one-pass stack-distance curve (`lru_curve`) against
     re-simulating every capacity with the sequential simulator (`simulate`). They must agree exactly at
     every capacity. Goal: the one-pass curve in under 5 s.
  2. OPT (Belady) at one capacity, 3 M tokens. Goal: under 10 s.
  3. Hit ratios at 1 M, 3 M and 10 M tokens on both traces: LRU, FIFO, LFU, the peers ARC and S3-FIFO
     (`benchmarks/policy_peers.py`), reuse-LRU, OPT, and the infinite cache (the maximum).
  4. Where the hits come from: hit blocks by how often the block had been used before, for LRU,
     reuse-LRU and OPT.
  5. Each 512-token block split into 32 blocks of 16 (about 9 M block references): the one-pass curve at
     100 capacities against re-simulating a few of them (the rest extrapolated, and said so), and OPT at
     3 M tokens, with block references per second.
  6. The engine's real block pool (analysis/pool_replay.py: `BlockPool` under LRU, driven as the KV cache
     manager drives it) replaying the whole conversation trace at 3 M tokens, at 512-token blocks and
     split into 16-token blocks: block references per second, with the pool's per-block events off (as
     the analyzer runs it) and on (as the engine runs it), next to the keys' hashing (the KV cache
     manager's job in the engine, done once per distinct block before the replay). Goal at 16 tokens:
     1 M references per second, the best of three replays (their median beside it). Hits must equal
     the one-pass curve's. The pool runs compiled (build_native.py); the same replays by its plain
     source (a copy of the packages without the compiled modules, in a subprocess) stand beside it.
  7. The timed mode (the engine's scheduler and pool, no model) on the first minutes of the conversation
     trace at a few pool sizes: hit ratio, queueing delay, peak blocks in use.
  (--sensitivity) reuse-LRU's three parameters around their defaults.

Timings are wall-clock on a machine shared with other work (2 cores): compare the ratios within one run.
Trace loading is timed on its own, outside every figure above.

Run: `.venv/bin/python benchmarks/analyzer.py [--traces DIR] [--quick] [--sensitivity] [--pool-only]`. The traces
default to `../shared/traces` next to the repository (or next to its parent, for a worktree in a
subfolder); without them the script says so and exits 0.
`--quick` re-simulates 10 capacities instead of 100 and skips section 5.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from analysis.analyzer import log_spaced_capacities  # noqa: E402
from analysis.policies import Policy  # noqa: E402
from analysis.pool_replay import PoolCache, prefix_keys  # noqa: E402
from analysis.readers import load_trace  # noqa: E402
from analysis.sequential import SequentialCache, infinite_hit_blocks, replay, simulate  # noqa: E402
from analysis.stack_distance import lru_curve  # noqa: E402
from analysis.timed import ServiceModel, run_timed  # noqa: E402
from analysis.trace import Trace, TraceRequest  # noqa: E402
from build_native import copy_plain_source  # noqa: E402
from engine.core.eviction import LruPolicy, ReuseLruPolicy  # noqa: E402
from engine.native_guard import NATIVE_MODULES, compiled_module  # noqa: E402
from policy_peers import ArcPolicy, S3FifoPolicy  # noqa: E402

TRACES = ("conversation", "synthetic")
CAPACITIES_TOKENS = (1_000_000, 3_000_000, 10_000_000)
OPT_CAPACITY_TOKENS = 3_000_000
CURVE_POINTS = 100
POOL_REPEATS = 3  # events-off replays of the pool per trace: the best of them (the machine is shared)
PEERS: dict[str, Callable[[int], object]] = {"arc": ArcPolicy, "s3-fifo": S3FifoPolicy}
# The timed example's engine: a GPU-class engine (assumed figures, not measured here), since the CPU
# engine's measured rates (analysis.timed.ServiceModel) serve a tiny fraction of the trace's arrivals
# (the conversation trace brings about 41,000 prompt tokens per second).
TIMED_SERVICE = ServiceModel(prefill_tokens_per_s=100_000, decode_tokens_per_s=10_000, max_num_seqs=256)


def timed(work: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


def hit_ratio(trace: Trace, hit_blocks: np.ndarray) -> float:
    return int(trace.hit_tokens(hit_blocks).sum()) / trace.input_tokens


def run_peer(trace: Trace, name: str, capacity_blocks: int) -> np.ndarray:
    cache = SequentialCache(capacity_blocks, PEERS[name](capacity_blocks))
    hits = replay(trace, cache)
    cache.check_invariants()
    return hits


def calibration() -> str:
    """How loaded the machine is: the load average and the time of a bare Python loop (an idle 2-core
    machine of this kind runs 10 M iterations in about 0.2 s)."""
    started = time.perf_counter()
    for _ in range(10_000_000):
        pass
    loop_s = time.perf_counter() - started
    load = os.getloadavg()
    return f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; 10 M empty Python loop turns in {loop_s:.2f} s"


def curve_against_simulation(trace: Trace, simulated: int, label: str, keys: list[bytes]) -> None:
    """Section 1 / 5: the one-pass curve at CURVE_POINTS capacities vs re-simulating `simulated` of them."""
    capacities = log_spaced_capacities(trace.unique_blocks, CURVE_POINTS)
    curve, curve_s = timed(lambda: lru_curve(trace))
    curve_hits = curve.hit_tokens_at(capacities)
    chosen = [capacities[round(i)] for i in np.linspace(0, len(capacities) - 1, min(simulated, len(capacities)))]
    total_s, disagreements = 0.0, 0
    for capacity in chosen:
        run, seconds = timed(lambda: simulate(trace, Policy.LRU, capacity, pool_keys=keys))
        total_s += seconds
        if int(trace.hit_tokens(run.hit_blocks).sum()) != curve_hits[capacities.index(capacity)]:
            disagreements += 1
    per_capacity = total_s / len(chosen)
    all_capacities_s = per_capacity * len(capacities)
    estimated = "" if len(chosen) == len(capacities) else f" (estimated from {len(chosen)} simulated)"
    print(f"\n{label}: {trace.num_references:,} block references, {trace.unique_blocks:,} unique blocks")
    print(f"  one-pass LRU curve, {len(capacities)} capacities:   {curve_s:8.2f} s  "
          f"({trace.num_references / curve_s / 1e6:.2f} M references/s)")
    print(f"  re-simulating each capacity (the block pool): {all_capacities_s:8.2f} s{estimated}  "
          f"({per_capacity:.2f} s per capacity, {trace.num_references / per_capacity / 1e6:.2f} M references/s)")
    print(f"  one pass is {all_capacities_s / curve_s:.1f}x faster; "
          f"agree at {len(chosen) - disagreements} of {len(chosen)} simulated capacities")
    if disagreements:
        raise SystemExit("the one-pass curve and the simulation disagree")


def opt_at_one_capacity(trace: Trace, label: str) -> None:
    capacity = OPT_CAPACITY_TOKENS // trace.block_size
    run, seconds = timed(lambda: simulate(trace, Policy.OPT, capacity))
    print(f"  OPT at {OPT_CAPACITY_TOKENS:,} tokens ({capacity:,} blocks), {label}: {seconds:.2f} s "
          f"({trace.num_references / seconds / 1e6:.2f} M references/s), hit ratio {hit_ratio(trace, run.hit_blocks):.4f}")


def policy_table(traces: dict[str, Trace], keys: dict[str, list[bytes]]) -> None:
    names = ["lru", "fifo", "lfu", "arc", "s3-fifo", "reuse-lru", "opt"]
    print("\nHit ratio (tokens) by policy; in brackets: / LRU.  max = infinite cache")
    print(f"  {'trace':<13}{'capacity':>10}" + "".join(f"{n:>16}" for n in names) + f"{'max':>9}")
    for trace_name, trace in traces.items():
        maximum = hit_ratio(trace, infinite_hit_blocks(trace))
        curve = lru_curve(trace)
        for capacity_tokens in CAPACITIES_TOKENS:
            capacity = capacity_tokens // trace.block_size
            ratios = {}
            for name in names:
                if name == "lru":
                    hits = curve.hit_blocks(capacity)
                elif name in PEERS:
                    hits = run_peer(trace, name, capacity)
                else:
                    hits = simulate(trace, Policy(name), capacity, pool_keys=keys[trace_name]).hit_blocks
                ratios[name] = hit_ratio(trace, hits)
            cells = "".join(f"{ratios[n]:>8.4f} ({ratios[n] / ratios['lru']:.2f})" for n in names)
            print(f"  {trace_name:<13}{capacity_tokens / 1e6:>8.0f} M{cells}{maximum:>9.4f}")


def hits_by_prior_uses(traces: dict[str, Trace], keys: dict[str, list[bytes]]) -> None:
    print("\nHit blocks by how often the block had been used before (1, 2, 3, 4+); reuses = infinite cache")
    for trace_name, trace in traces.items():
        dense = trace.dense.ids
        order = np.argsort(dense, kind="stable")
        first = np.searchsorted(dense[order], dense[order])  # first position of each block in `order`
        prior = np.empty_like(dense)
        prior[order] = np.arange(len(dense)) - first  # earlier references of the same block
        position = np.arange(trace.num_references) - trace.block_starts[trace.request_of_reference]
        classes = np.minimum(prior, 4)

        def tally(hit_blocks: np.ndarray) -> list[int]:
            hit = position < hit_blocks[trace.request_of_reference]
            return [int(np.sum(hit & (classes == c))) for c in (1, 2, 3, 4)]

        print(f"  {trace_name}: reuses {tally(infinite_hit_blocks(trace))}")
        for capacity_tokens in CAPACITIES_TOKENS[:2]:
            capacity = capacity_tokens // trace.block_size
            rows = {
                p.value: tally(simulate(trace, p, capacity, pool_keys=keys[trace_name]).hit_blocks)
                for p in (Policy.LRU, Policy.REUSE_LRU, Policy.OPT)
            }
            print(f"    {capacity_tokens / 1e6:.0f} M: " + "   ".join(f"{name} {row}" for name, row in rows.items()))


def sensitivity(traces: dict[str, Trace], keys: dict[str, list[bytes]]) -> None:
    print("\nreuse-LRU around its defaults (credit 2 capacities per reuse, 2 tiers, history 4 per block): "
          "hit ratio / LRU at 1, 3, 10 M tokens, conversation | synthetic")
    curves = {name: lru_curve(trace) for name, trace in traces.items()}
    for credit, tiers, history in itertools.product((1.0, 2.0, 4.0), (1, 2, 3), (0, 4)):
        cells = []
        for name, trace in traces.items():
            for capacity_tokens in CAPACITIES_TOKENS:
                capacity = capacity_tokens // trace.block_size
                policy = ReuseLruPolicy(capacity, credit_per_reuse=credit, max_tier=tiers, history_per_block=history)
                hits = replay(trace, PoolCache(trace, capacity, policy, keys=keys[name]))
                cells.append(f"{int(trace.hit_tokens(hits).sum()) / curves[name].hit_tokens(capacity):.2f}")
            cells.append("|")
        print(f"  credit {credit:.0f} tiers {tiers} history {history:>2}:  " + " ".join(cells[:-1]))


def pool_replays(trace: Trace, keys: list[bytes], expected: np.ndarray, recording: bool, repeats: int) -> list[float]:
    """Seconds of `repeats` replays of `trace` through a fresh pool of OPT_CAPACITY_TOKENS under LRU, with
    events on or off; each must hit `expected` (the one-pass curve's hits at that capacity)."""
    capacity = OPT_CAPACITY_TOKENS // trace.block_size
    runs = []
    for _ in range(repeats):
        cache = PoolCache(trace, capacity, LruPolicy(), keys=keys)
        cache.log.recording = recording
        hits, seconds = timed(lambda: replay(trace, cache))
        if not np.array_equal(hits, expected):
            raise SystemExit("the block pool and the one-pass curve disagree")
        runs.append(seconds)
    return runs


def pool_build() -> str:
    """What section 6 measures: the compiled pool, or its plain source when it was not built (a stale
    build never gets this far: importing engine.core refused it)."""
    root = Path(__file__).resolve().parents[1]
    if all(compiled_module(root / name) is not None for name in NATIVE_MODULES):
        return "compiled"
    return "plain source: not compiled, run `make native`"


def pool_rates(conversation: Trace, quick: bool) -> dict[str, float]:
    """Section 6's events-off replays at 512-token blocks and (unless `quick`) 16-token ones: the best of
    POOL_REPEATS, in M references/s, by block size."""
    rates = {}
    for trace in (conversation, None if quick else conversation.split(16)):
        if trace is not None:
            expected = lru_curve(trace).hit_blocks(OPT_CAPACITY_TOKENS // trace.block_size)
            runs = pool_replays(trace, prefix_keys(trace), expected, False, POOL_REPEATS)
            rates[str(trace.block_size)] = trace.num_references / min(runs) / 1e6
    return rates


def plain_source_rates(traces: Path, quick: bool) -> dict[str, float]:
    """`pool_rates` run by the pool's plain source: this script in a copy of the packages without the
    compiled modules, in a subprocess."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as copy:
        copy_plain_source(root, Path(copy), ("engine", "analysis", "benchmarks"))
        command = [sys.executable, f"{copy}/benchmarks/analyzer.py", "--traces", str(traces), "--plain-rates"]
        command += ["--quick"] if quick else []
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def pool_throughput(trace: Trace, label: str, keys: list[bytes], keys_s: float, plain_rate: float | None) -> None:
    """Section 6: the real block pool at 3 M tokens, events off and on, against the curve's hits, beside the
    plain source's rate with events off (`plain_rate`, M references/s)."""
    capacity = OPT_CAPACITY_TOKENS // trace.block_size
    expected = lru_curve(trace).hit_blocks(capacity)
    print(f"\nThe engine's block pool replaying {label} at {OPT_CAPACITY_TOKENS:,} tokens "
          f"({capacity:,} blocks), LRU:")  # fmt: skip
    print(f"  keys: {trace.unique_blocks:,} distinct blocks hashed in {keys_s:.2f} s (the KV cache manager's work)")
    for recording in (False, True):
        runs = pool_replays(trace, keys, expected, recording, 1 if recording else POOL_REPEATS)
        what = "events on (as the engine)" if recording else "events off (as the analyzer)"
        seconds, rate = min(runs), trace.num_references / min(runs) / 1e6
        spread = "" if len(runs) == 1 else f"; best of {len(runs)}, median {statistics.median(runs):.2f} s"
        print(f"  {what:<29} {seconds:8.2f} s  {rate:6.3f} M references/s  (hits equal the curve's{spread})")
        if not recording and plain_rate is not None:
            print(f"  {'plain source, events off':<29} {trace.num_references / plain_rate / 1e6:8.2f} s  "
                  f"{plain_rate:6.3f} M references/s  (compiled / plain source: {rate / plain_rate:.2f}x)")  # fmt: skip


def timed_example(trace: Trace, minutes: float, service: ServiceModel) -> None:
    """Section 7: the timed mode on the trace's first `minutes`."""
    first = trace.arrival_s <= trace.arrival_s[0] + 60 * minutes
    count = int(first.sum())
    starts = trace.block_starts
    requests = [
        TraceRequest(float(trace.arrival_s[r]), int(trace.input_lengths[r]), int(trace.output_lengths[r]),
                     tuple(trace.block_ids[starts[r]:starts[r + 1]].tolist()), trace.block_size)
        for r in range(count)
    ]  # fmt: skip
    head = Trace.from_requests(requests, trace.format)
    view = head.full_blocks_only()
    curve = lru_curve(view)
    print(f"\nTimed mode, the conversation trace's first {minutes:g} minutes ({count:,} requests, "
          f"{head.input_tokens:,} prompt tokens), service model {service.prefill_tokens_per_s:,.0f} prefill and "
          f"{service.decode_tokens_per_s:,.0f} decode tokens/s (assumed: see below), LRU:")  # fmt: skip
    print(f"  {'pool (tokens)':>14}{'hit ratio':>11}{'sequential':>12}{'queue p50':>11}{'p99':>9}{'peak blocks':>13}"
          f"{'preempted':>11}{'wall s':>8}")  # fmt: skip
    for capacity_tokens in (250_000, 1_000_000, 3_000_000):
        blocks = capacity_tokens // head.block_size
        run, seconds = timed(lambda: run_timed(head, blocks, LruPolicy(), service))
        ratio = int(head.hit_tokens(run.hit_blocks).sum()) / head.input_tokens
        sequential = int(view.hit_tokens(curve.hit_blocks(blocks)).sum()) / head.input_tokens
        q = run.queueing_percentiles()
        print(f"  {capacity_tokens:>14,}{ratio:>11.4f}{sequential:>12.4f}{q['p50']:>10.2f}s{q['p99']:>8.2f}s"
              f"{run.peak_blocks_in_use:>13,}{run.preemptions:>11,}{seconds:>8.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    repository = Path(__file__).resolve().parents[1]
    # ../shared/traces next to the repository; a worktree under <checkout parent>/wt/ looks one level up.
    candidates = [repository.parent / "shared" / "traces", repository.parent.parent / "shared" / "traces"]
    default_traces = next((path for path in candidates if path.is_dir()), candidates[0])
    parser.add_argument("--traces", type=Path, default=default_traces, help="folder with the Mooncake traces")
    parser.add_argument("--quick", action="store_true", help="10 simulated capacities, no 16-token section")
    parser.add_argument("--sensitivity", action="store_true", help="also scan reuse-LRU's parameters")
    parser.add_argument("--pool-only", action="store_true", help="section 6 alone: the real block pool's speed")
    parser.add_argument("--plain-rates", action="store_true", help=argparse.SUPPRESS)  # plain_source_rates' child
    args = parser.parse_args()
    paths = {name: args.traces / f"{name}_trace.jsonl" for name in TRACES}
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing:
        print(f"skipped: no Mooncake traces ({', '.join(missing)} missing); pass --traces DIR")
        return
    if args.plain_rates:
        print(json.dumps(pool_rates(load_trace(paths["conversation"]), args.quick)))
        return
    print("Workload analyzer benchmark (wall-clock on a shared 2-core machine; compare ratios within this run)")
    print(f"  the engine's block pool: {pool_build()}")
    print(f"  {calibration()}")
    traces = {}
    for name, path in paths.items():
        traces[name], seconds = timed(lambda: load_trace(path))
        print(f"  loaded {name}: {len(traces[name]):,} requests, {traces[name].num_references:,} references "
              f"in {seconds:.2f} s")
    keys, keys_s = {}, {}
    for name, trace in traces.items():
        keys[name], keys_s[name] = timed(lambda: prefix_keys(trace))
    conversation = traces["conversation"]
    plain, plain_s = timed(lambda: plain_source_rates(args.traces, args.quick))
    print(f"  the plain source's pool replays (section 6) ran in a subprocess in {plain_s:.0f} s")
    if args.pool_only:
        pool_throughput(conversation, "the conversation trace, 512-token blocks", keys["conversation"],
                        keys_s["conversation"], plain["512"])  # fmt: skip
        split = conversation.split(16)
        split_keys, split_keys_s = timed(lambda: prefix_keys(split))
        pool_throughput(split, "the conversation trace, 16-token blocks", split_keys, split_keys_s, plain.get("16"))
        print(f"  {calibration()}")
        return
    curve_against_simulation(
        conversation, 10 if args.quick else CURVE_POINTS, "conversation, 512-token blocks", keys["conversation"]
    )
    opt_at_one_capacity(conversation, "conversation, 512-token blocks")
    pool_throughput(conversation, "the conversation trace, 512-token blocks", keys["conversation"],
                    keys_s["conversation"], plain["512"])  # fmt: skip
    policy_table(traces, keys)
    hits_by_prior_uses(traces, keys)
    if not args.quick:
        split, seconds = timed(lambda: conversation.split(16))
        print(f"\n  split into 16-token blocks in {seconds:.2f} s")
        split_keys, split_keys_s = timed(lambda: prefix_keys(split))
        pool_throughput(split, "the conversation trace, 16-token blocks", split_keys, split_keys_s, plain["16"])
        curve_against_simulation(split, 3, "conversation, 16-token blocks", split_keys)
        opt_at_one_capacity(split, "conversation, 16-token blocks")
        del split_keys
    timed_example(conversation, 5 if args.quick else 15, TIMED_SERVICE)
    if args.sensitivity:
        sensitivity(traces, keys)


if __name__ == "__main__":
    main()
