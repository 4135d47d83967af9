"""The analysis a user asks for: hit ratios of some policies at some capacities, and why they miss.

`analyze(trace, config, progress)` runs in one of two modes (`Mode`):

  * sequential: the infinite cache once, the one-pass LRU curve once (when LRU is asked for: every LRU
    point is read off it), reuse-LRU through the engine's block pool, and one sequential simulation per
    other (policy, capacity);
  * timed: per (policy, capacity), the engine's scheduler and block pool serving the trace at its
    arrival times (`analysis.timed`), with the sequential mode on the engine's view of the trace (full
    blocks only) at the same pool size as the reference its `pinned` misses are measured against.

Each point carries its miss breakdown, its hits per request type, its top prefixes and what its hits
save in prefill time. With `AnalysisConfig.tiers` (sequential mode) each capacity also gets a disk tier of
each size behind an LRU pool of that capacity, read off the same curve (`analysis.tier_plan`) and, if
asked, simulated under this engine's tier rule (`analysis.tiers`). `analysis.report.to_json` turns the result into the CLI's JSON.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from analysis.breakdown import (
    HitBounds,
    MissBreakdown,
    PrefixSavings,
    TypeHits,
    hit_bounds,
    hits_by_type,
    miss_breakdown,
    top_prefixes,
)
from analysis.policies import Policy
from analysis.pool_replay import prefix_keys
from analysis.sequential import PolicyRun, simulate
from analysis.stack_distance import LruCurve, lru_curve
from analysis.tier_plan import TierConfig, TierPoint, TierSize, tier_point, trace_hours
from analysis.tiers import TierRule, simulate_tiers
from analysis.timed import ServiceModel, TimedRun, run_timed
from analysis.trace import Trace
from engine.core.eviction import make_eviction_policy

MAX_POINTS = 1000  # (policy, capacity) pairs one analysis may ask for
MAX_TOP_PREFIXES = 1000  # prefixes one point may list
MAX_COST_PER_HOUR = 1e9  # an operator-typed bound (any currency): keeps every price finite
SECONDS_PER_HOUR = 3600.0


class Mode(enum.Enum):
    """How requests meet the cache."""

    SEQUENTIAL = "sequential"  # one at a time: each request's blocks are evictable before the next arrives
    TIMED = "timed"  # at their arrival times, through the engine's scheduler: running requests hold blocks


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
    mode: Mode = Mode.SEQUENTIAL  # how requests meet the cache
    service: ServiceModel = field(default_factory=ServiceModel)  # step times (timed mode; and the savings)
    cost_per_hour: float | None = None  # what an hour of the engine costs (any currency): savings in money
    tiers: TierConfig | None = None  # sequential mode: a disk tier of each size behind each capacity (LRU)

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
        if self.mode is Mode.TIMED and any(policy.in_block_pool is None for policy in self.policies):
            engine = ", ".join(p.value for p in Policy if p.in_block_pool is not None)
            raise ValueError(f"the timed mode runs the engine's scheduler and pool: its policies only ({engine})")
        if self.cost_per_hour is not None and not 0 <= self.cost_per_hour <= MAX_COST_PER_HOUR:
            raise ValueError(f"cost_per_hour must be a number in [0, {MAX_COST_PER_HOUR:g}]")
        if self.tiers is not None:
            if self.mode is Mode.TIMED:
                raise ValueError("the disk tier is modelled in the sequential mode only")
            if len(self.capacities_tokens) * len(self.tiers.sizes_gib) > MAX_POINTS:
                raise ValueError(f"at most {MAX_POINTS} (capacity, disk tier) points per analysis")


@dataclass(frozen=True)
class TimedStats:
    """What the timed mode adds to a point."""

    queueing_s: dict[str, float]  # queueing delay (first scheduled - arrival) percentiles: p50, p90, p99, max
    peak_blocks_in_use: int  # most blocks running requests held at once
    preemptions: int  # running requests that lost their blocks to let another grow
    rejected: int  # requests too large for the whole pool
    makespan_s: float  # virtual time when the last request finished
    steps: int  # scheduler steps


@dataclass(frozen=True)
class Savings:
    """What hits save, priced with the service model's prefill rate."""

    prefill_s: float  # prefill seconds the hit tokens would have cost
    prefill_s_per_trace_hour: float | None  # the same per hour of trace time (None: the trace has no duration)
    cost_per_trace_hour: float | None  # prefill_s_per_trace_hour in engine hours x cost_per_hour, if priced


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
    savings: Savings  # prefill time (and money) the hits save
    timed: TimedStats | None = None  # the timed mode's queueing and occupancy; None in the sequential mode


@dataclass(frozen=True)
class Analysis:
    """Everything `analyze` found."""

    trace: Trace  # the analysed trace (in the timed mode: its full blocks, as the engine keys them)
    mode: Mode  # how requests met the cache
    unique_blocks: int  # distinct block ids
    max_hit_tokens: int  # prompt tokens an infinite cache hits
    max_hit_ratio: float  # max_hit_tokens / input tokens: no cache or policy does better
    unavoidable: MissBreakdown  # the infinite cache's misses (compulsory, partial, namespace)
    max_by_type: tuple[TypeHits, ...]  # the infinite cache's hits per request type
    max_top_prefixes: tuple[PrefixSavings, ...]  # the prefixes that save the most in an infinite cache
    curve: tuple[CurvePoint, ...]  # one point per (policy, capacity), policies outer, in config order
    seconds: float  # wall time of the analysis
    tiers: tuple[TierPoint, ...] = ()  # per (capacity, disk tier), capacities outer, in config order


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
    """Evaluate every (policy, capacity) of `config` on `trace` in the configured mode.

    Raises:
        TraceError: reuse-LRU on a trace whose ids change parents (the engine's pool cannot replay it).
        ValueError: the timed mode at a capacity below one block.
    """
    started = time.perf_counter()
    if config.mode is Mode.TIMED:
        return _analyze_timed(trace, config, progress, started)
    simulated = [p for p in config.policies if p is not Policy.LRU]
    tiers = config.tiers
    needs_curve = Policy.LRU in config.policies or tiers is not None
    tier_passes = len(config.capacities_tokens) * len(tiers.sizes_gib) if tiers is not None and tiers.simulate else 0
    passes = 1 + needs_curve + len(simulated) * len(config.capacities_tokens) + tier_passes
    meter = _Meter(progress, len(trace), passes)

    meter.start("infinite cache")
    bounds = hit_bounds(trace)
    meter.advance(len(trace))
    keys = prefix_keys(trace) if any(p.in_block_pool is not None for p in simulated) else None
    curve = None
    if needs_curve:
        meter.start("LRU at every capacity (stack distances)")
        curve = lru_curve(trace, meter.advance)
    runs: dict[tuple[Policy, int], PolicyRun] = {}
    for policy in config.policies:
        if curve is not None and policy is Policy.LRU:
            for capacity in config.capacities_tokens:
                runs[policy, capacity] = curve.run(capacity // trace.block_size)
            continue
        for capacity in config.capacities_tokens:
            meter.start(f"{policy.value} at {capacity:,} tokens")
            blocks = capacity // trace.block_size
            runs[policy, capacity] = simulate(trace, policy, blocks, on_requests=meter.advance, pool_keys=keys)
    points = [
        _point(trace, config, runs[policy, capacity].hit_blocks, bounds, _Where(policy, capacity))
        for policy in config.policies
        for capacity in config.capacities_tokens
    ]
    tier_rows = () if tiers is None or curve is None else _tier_points(curve, config, tiers, meter)
    return replace(_analysis(trace, config, bounds, tuple(points), started), tiers=tier_rows)


def _tier_points(curve: LruCurve, config: AnalysisConfig, tiers: TierConfig, meter: _Meter) -> tuple[TierPoint, ...]:
    """Every (capacity, disk tier) point off the curve, each also simulated directly if asked."""
    trace, rows = curve.trace, []
    for capacity in config.capacities_tokens:
        for gib in tiers.sizes_gib:
            point = tier_point(curve, TierSize(capacity, gib), tiers.disk, config.service)
            if tiers.simulate:
                meter.start(f"disk tier of {gib:g} GiB behind {capacity:,} tokens (this engine's rule)")
                run = simulate_tiers(trace, point.pool_blocks, point.tier_blocks, TierRule.INCLUSIVE, meter.advance)
                point = replace(point, simulated_hit_tokens=int(trace.hit_tokens(run.hit_blocks).sum()))
            rows.append(point)
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class _Where:
    """A point's place in the curve, and what the timed mode adds to it."""

    policy: Policy
    capacity_tokens: int
    reference_blocks: np.ndarray | None = None  # timed: the sequential reference's hits (for `pinned`)
    timed: TimedRun | None = None


def _analyze_timed(trace: Trace, config: AnalysisConfig, progress: ProgressCallback | None, started: float) -> Analysis:
    engine_view = trace.full_blocks_only()  # what the engine keys: full blocks
    bounds = hit_bounds(engine_view, engine_cap=True)
    passes = 1 + len(config.policies) * len(config.capacities_tokens)
    meter = _Meter(progress, len(trace), passes)
    meter.start("references: one request at a time, full blocks")
    curve: LruCurve | None = lru_curve(engine_view) if Policy.LRU in config.policies else None
    keys = prefix_keys(engine_view) if Policy.REUSE_LRU in config.policies else None
    meter.advance(len(trace))
    points = []
    for policy in config.policies:
        for capacity in config.capacities_tokens:
            blocks = capacity // trace.block_size
            if blocks < 1:
                raise ValueError(f"{capacity:,} tokens is less than one block of {trace.block_size}: no pool to run")
            meter.start(f"{policy.value} at {capacity:,} tokens, timed")
            engine_policy = make_eviction_policy(policy.in_block_pool, blocks)  # type: ignore[arg-type]
            run = run_timed(trace, blocks, engine_policy, config.service, meter.advance)
            if curve is not None and policy is Policy.LRU:
                reference = curve.hit_blocks(blocks)
            else:
                reference = simulate(engine_view, policy, blocks, pool_keys=keys).hit_blocks
            where = _Where(policy, capacity, reference, run)
            points.append(_point(engine_view, config, run.hit_blocks, bounds, where))
    return _analysis(engine_view, config, bounds, tuple(points), started)


def _point(trace: Trace, config: AnalysisConfig, hit_blocks: np.ndarray, bounds: HitBounds, where: _Where) -> CurvePoint:
    hit = int(trace.hit_tokens(hit_blocks).sum())
    timed = None
    if where.timed is not None:
        run = where.timed
        timed = TimedStats(
            run.queueing_percentiles(),
            run.peak_blocks_in_use,
            run.preemptions,
            int(run.rejected.sum()),
            run.makespan_s,
            run.steps,
        )
    return CurvePoint(
        where.policy,
        where.capacity_tokens,
        where.capacity_tokens // trace.block_size,
        hit,
        hit / trace.input_tokens,
        miss_breakdown(trace, hit_blocks, bounds, where.reference_blocks),
        hits_by_type(trace, hit_blocks),
        top_prefixes(trace, hit_blocks, config.top_prefixes),
        savings(trace, hit, config),
        timed,
    )


def savings(trace: Trace, hit_tokens: int, config: AnalysisConfig) -> Savings:
    """What `hit_tokens` saved over `trace`: prefill seconds at the service model's rate, per hour of the
    trace's time span (none for a trace whose requests all arrive at once), priced if a cost is set."""
    seconds = hit_tokens / config.service.prefill_tokens_per_s
    span_h = trace_hours(trace)
    per_hour = seconds / span_h if span_h is not None else None
    cost = None
    if per_hour is not None and config.cost_per_hour is not None:
        cost = per_hour / SECONDS_PER_HOUR * config.cost_per_hour
    return Savings(seconds, per_hour, cost)


def _analysis(
    trace: Trace, config: AnalysisConfig, bounds: HitBounds, points: tuple[CurvePoint, ...], started: float
) -> Analysis:
    max_hit = int(trace.hit_tokens(bounds.infinite).sum())
    return Analysis(
        trace,
        config.mode,
        trace.unique_blocks,
        max_hit,
        max_hit / trace.input_tokens,
        miss_breakdown(trace, bounds.infinite, bounds),
        hits_by_type(trace, bounds.infinite),
        top_prefixes(trace, bounds.infinite, config.top_prefixes),
        points,
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
