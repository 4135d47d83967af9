"""The analysis a user asks for: hit ratios of some policies at some capacities, and why they miss.

`analyze(trace, config, progress)` runs the infinite cache once, the one-pass LRU curve once (when LRU
is asked for: every LRU point is read off it), and one sequential simulation per other (policy,
capacity). Each point carries its miss breakdown, its hits per request type and its top prefixes.
`analysis.report.to_json` turns the result into the CLI's JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from analysis.breakdown import MissBreakdown, PrefixSavings, TypeHits, hits_by_type, miss_breakdown, top_prefixes
from analysis.policies import Policy
from analysis.sequential import PolicyRun, infinite_hit_blocks, simulate
from analysis.stack_distance import lru_curve
from analysis.trace import Trace

MAX_POINTS = 1000  # (policy, capacity) pairs one analysis may ask for
MAX_TOP_PREFIXES = 1000  # prefixes one point may list


@dataclass(frozen=True, slots=True)
class Progress:
    """How far an analysis is, for a progress bar. Work is counted in requests simulated."""

    stage: str  # what runs now, e.g. "fifo at 1,048,576 tokens"
    done: int  # requests simulated so far, over all stages
    total: int  # requests the whole analysis simulates


ProgressCallback = Callable[[Progress], None]  # may raise to stop the analysis (the error propagates)


@dataclass(frozen=True)
class AnalysisConfig:
    """What to compute. Capacities are in tokens; each becomes `capacity_tokens // block_size` blocks."""

    capacities_tokens: tuple[int, ...]  # cache sizes to evaluate, in the order to report them
    policies: tuple[Policy, ...] = (Policy.LRU,)  # policies to evaluate at every capacity
    top_prefixes: int = 10  # hit prefixes listed per point

    def __post_init__(self) -> None:
        if not self.capacities_tokens or not self.policies:
            raise ValueError("name at least one capacity and one policy")
        if any(type(c) is not int or c < 0 for c in self.capacities_tokens):
            raise ValueError(f"capacities must be integers >= 0 tokens, got {self.capacities_tokens}")
        if len(set(self.capacities_tokens)) < len(self.capacities_tokens):
            raise ValueError("a capacity is named twice")
        if len(set(self.policies)) < len(self.policies):
            raise ValueError("a policy is named twice")
        if len(self.capacities_tokens) * len(self.policies) > MAX_POINTS:
            raise ValueError(f"at most {MAX_POINTS} (policy, capacity) points per analysis")
        if not 0 <= self.top_prefixes <= MAX_TOP_PREFIXES:
            raise ValueError(f"top_prefixes must be in [0, {MAX_TOP_PREFIXES}]")


@dataclass(frozen=True)
class CurvePoint:
    """One policy at one capacity."""

    policy: Policy  # the eviction policy
    capacity_tokens: int  # the capacity asked for
    capacity_blocks: int  # capacity_tokens // block_size
    hit_tokens: int  # prompt tokens hit
    hit_ratio: float  # hit_tokens / input tokens
    misses: MissBreakdown  # the other prompt tokens, by reason
    by_type: tuple[TypeHits, ...]  # hits per request type (empty without types)
    top_prefixes: tuple[PrefixSavings, ...]  # the prefixes that saved the most tokens here


@dataclass(frozen=True)
class Analysis:
    """Everything `analyze` found."""

    trace: Trace  # the analysed trace
    unique_blocks: int  # distinct block ids
    max_hit_tokens: int  # prompt tokens an infinite cache hits
    max_hit_ratio: float  # max_hit_tokens / input tokens: no cache or policy does better
    unavoidable: MissBreakdown  # the infinite cache's misses (compulsory and partial: every cache has them)
    max_by_type: tuple[TypeHits, ...]  # the infinite cache's hits per request type
    max_top_prefixes: tuple[PrefixSavings, ...]  # the prefixes that save the most in an infinite cache
    curve: tuple[CurvePoint, ...]  # one point per (policy, capacity), policies outer, in config order
    seconds: float  # wall time of the analysis


def log_spaced_capacities(max_blocks: int, count: int) -> tuple[int, ...]:
    """`min(count, max_blocks)` distinct capacities in blocks from 1 to `max_blocks`, log-spaced (where
    rounding would repeat a small capacity, the next integer is taken instead)."""
    if max_blocks < 1 or count < 1:
        raise ValueError("max_blocks and count must be positive")
    capacities: list[int] = []
    for value in np.rint(np.geomspace(1, max_blocks, min(count, max_blocks))).astype(np.int64).tolist():
        capacities.append(max(value, capacities[-1] + 1) if capacities else value)
    return tuple(capacities)


def analyze(trace: Trace, config: AnalysisConfig, progress: ProgressCallback | None = None) -> Analysis:
    """Evaluate every (policy, capacity) of `config` on `trace` in the sequential mode."""
    started = time.perf_counter()
    simulated = [p for p in config.policies if p is not Policy.LRU]
    passes = 1 + (Policy.LRU in config.policies) + len(simulated) * len(config.capacities_tokens)
    meter = _Meter(progress, len(trace), passes)

    meter.start("infinite cache")
    infinite = infinite_hit_blocks(trace)
    meter.advance(len(trace))
    runs: dict[tuple[Policy, int], PolicyRun] = {}
    for policy in config.policies:
        if policy is Policy.LRU:
            meter.start("LRU at every capacity (stack distances)")
            curve = lru_curve(trace, meter.advance)
            for capacity in config.capacities_tokens:
                runs[policy, capacity] = curve.run(capacity // trace.block_size)
            continue
        for capacity in config.capacities_tokens:
            meter.start(f"{policy.value} at {capacity:,} tokens")
            runs[policy, capacity] = simulate(trace, policy, capacity // trace.block_size, on_requests=meter.advance)

    points = []
    for policy in config.policies:
        for capacity in config.capacities_tokens:
            run = runs[policy, capacity]
            hit = int(trace.hit_tokens(run.hit_blocks).sum())
            points.append(
                CurvePoint(
                    policy,
                    capacity,
                    run.capacity_blocks,
                    hit,
                    hit / trace.input_tokens,
                    miss_breakdown(trace, run.hit_blocks, infinite),
                    hits_by_type(trace, run.hit_blocks),
                    top_prefixes(trace, run.hit_blocks, config.top_prefixes),
                )
            )
    max_hit = int(trace.hit_tokens(infinite).sum())
    return Analysis(
        trace,
        trace.unique_blocks,
        max_hit,
        max_hit / trace.input_tokens,
        miss_breakdown(trace, infinite, infinite),
        hits_by_type(trace, infinite),
        top_prefixes(trace, infinite, config.top_prefixes),
        tuple(points),
        time.perf_counter() - started,
    )


class _Meter:
    """Turns each pass's "requests done" into one `Progress` over the whole analysis."""

    def __init__(self, callback: ProgressCallback | None, requests: int, passes: int) -> None:
        self._callback = callback
        self._total = requests * passes
        self._finished = 0  # requests of the passes already done
        self._stage = ""
        self._pass_done = 0

    def start(self, stage: str) -> None:
        self._finished += self._pass_done
        self._pass_done = 0
        self._stage = stage
        self._report()

    def advance(self, done_in_pass: int) -> None:
        self._pass_done = done_in_pass
        self._report()

    def _report(self) -> None:
        if self._callback is not None:
            self._callback(Progress(self._stage, self._finished + self._pass_done, self._total))
