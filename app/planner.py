"""The Capacity planner's analyses: one background job per browser session, and the frames the page draws.

    job = PlannerJob(load, PlannerRequest(block_size=None, policies=(...), engine_capacity_tokens=16384))
    job.start()                 # a daemon thread: load the trace, the LRU curve, every policy's points
    job.snapshot()              # JobSnapshot(state, progress, result, error): what the page polls
    job.cancel()                # the analysis stops at its next progress tick

The page keeps the job in its session state and polls it from a fragment; the job's thread never calls
Streamlit, and no other page waits for it. `load` is a function the page builds for the trace the
operator chose (a shipped sample, an upload checked by `read_upload`, or the history's prompt keys), so
reading it happens on the job's thread too.

The curve: LRU at `DENSE_POINTS` log-spaced capacities (free: the one-pass curve), every chosen policy at
`POLICY_POINTS` of them plus the running engine's pool size, the capacity LRU needs for 50, 80, 90 and
95 % of the maximum, each point's miss breakdown and hot prefixes; `purchase_frame` says what those
capacities take to buy (analysis/purchase.py), weights and KV in the served dtype (`SERVED_DTYPE` to start with);
`tier_frame` and `engine_tier_point` put a disk tier behind the pool (analysis/tier_plan.py), off the same curve.
"""

from __future__ import annotations

import enum
import io
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from analysis.analyzer import Analysis, AnalysisConfig, Progress, analyze, log_spaced_capacities
from analysis.errors import TraceError
from analysis.policies import Policy
from analysis.purchase import Accelerator, ModelShape, purchase
from analysis.readers import detect_format, load_trace, numbered_lines
from analysis.stack_distance import LruCurve, lru_curve
from analysis.tier_plan import DiskModel, TierPoint, TierSize, tier_point
from analysis.timed import ServiceModel
from analysis.trace import Trace, TraceFormat

MAX_UPLOAD_BYTES = 16 * 2**20  # the largest trace an operator may upload (both Mooncake traces fit)
DENSE_POINTS = 80  # LRU capacities on the chart
POLICY_POINTS = 12  # capacities every other policy is simulated at
SHARES_OF_MAX = (0.5, 0.8, 0.9, 0.95)  # the "capacity needed for x % of the maximum" rows
TOP_PREFIXES = 20
# The dtype "what to buy" prices weights and KV in unless the operator picks another: what a GPU deployment
# serves. The console itself runs float32 on a CPU, which would price twice the bytes.
SERVED_DTYPE = "bfloat16"
REASONS = ("compulsory", "capacity", "partial", "pinned", "namespace")  # MissBreakdown's fields, report order

logger = logging.getLogger(__name__)


class JobState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # the trace or the options were refused (error says why)
    CANCELLED = "cancelled"


class JobCancelled(Exception):
    """Raised by the progress callback to stop an analysis the operator cancelled."""


@dataclass(frozen=True)
class PlannerRequest:
    """What the operator asked for."""

    block_size: int | None  # split a hash-id trace to this block size; None: as it comes
    policies: tuple[Policy, ...]  # the policies to compare (LRU is always computed: the marker and rows use it)
    engine_capacity_tokens: int  # the running engine's pool, in tokens (a marker and a breakdown point)


@dataclass(frozen=True)
class PlannerResult:
    """What the page draws."""

    analysis: Analysis  # every policy at every evaluated capacity, with breakdowns and prefixes
    lru: pd.DataFrame  # capacity_tokens, hit_ratio, miss_ratio: the dense LRU curve
    needed: pd.DataFrame  # share_of_max, hit_ratio, capacity_tokens: what LRU needs for each share
    engine_capacity_tokens: int  # where the running engine's pool sits on the curve
    curve: LruCurve  # the one-pass LRU curve: every capacity, and every pool + disk tier (`tier_frame`)


@dataclass(frozen=True)
class JobSnapshot:
    state: JobState
    progress: Progress | None  # the latest tick (None before the first)
    result: PlannerResult | None  # set when DONE
    error: str | None  # set when FAILED


def read_upload(data: bytes, trace_format: TraceFormat | None = None) -> Trace:
    """An uploaded trace file, bounded in size and read like any trace file.

    Args:
        data: the file's bytes.
        trace_format: its format as the operator chose it; None detects it from the first line.

    Raises:
        TraceError: too large, of a format that cannot be detected (the message names the page's Format
            box), or not a valid trace (the reader's message, with the line).
    """
    if len(data) > MAX_UPLOAD_BYTES:
        raise TraceError(f"the file has {len(data) / 2**20:.1f} MiB; at most {MAX_UPLOAD_BYTES // 2**20} MiB")
    if trace_format is None:
        first = next(numbered_lines(io.BytesIO(data)), None)
        if first is not None:
            try:
                trace_format = detect_format(first[1], first[0])
            except TraceError as error:
                if error.reason.startswith("cannot tell"):
                    raise TraceError(
                        "cannot tell the trace format (no hash_ids or chat_id field): choose it under Format", first[0]
                    ) from None
                raise
    return load_trace(io.BytesIO(data), trace_format)


def plan(trace: Trace, request: PlannerRequest, progress: Callable[[Progress], None] | None = None) -> PlannerResult:
    """The whole analysis the page shows (see the module docstring).

    Raises:
        TraceError, ValueError: a block size the trace cannot be split to, or a trace a policy refuses.
    """
    if request.block_size is not None and request.block_size != trace.block_size:
        trace = trace.split(request.block_size)
    curve = lru_curve(trace)
    unique = max(trace.unique_blocks, 1)
    dense_blocks = log_spaced_capacities(unique, DENSE_POINTS)
    hit = curve.hit_tokens_at(dense_blocks) / trace.input_tokens
    lru = pd.DataFrame({"capacity_tokens": [b * trace.block_size for b in dense_blocks], "hit_ratio": hit})
    lru["miss_ratio"] = 1.0 - lru["hit_ratio"]
    capacities = {b * trace.block_size for b in log_spaced_capacities(unique, POLICY_POINTS)}
    capacities.add(request.engine_capacity_tokens)
    policies = tuple(dict.fromkeys((Policy.LRU, *request.policies)))
    config = AnalysisConfig(tuple(sorted(capacities)), policies, TOP_PREFIXES)
    analysis = analyze(trace, config, progress)
    rows = []
    for share in SHARES_OF_MAX:
        target = math.ceil(share * curve.max_hit_tokens)
        rows.append((share, target / trace.input_tokens, curve.min_capacity_for(target) * trace.block_size))
    needed = pd.DataFrame(rows, columns=["share_of_max", "hit_ratio", "capacity_tokens"])
    return PlannerResult(analysis, lru, needed, request.engine_capacity_tokens, curve)


def tier_frame(result: PlannerResult, tier_gib: float, disk: DiskModel) -> pd.DataFrame:
    """The two-tier curve at the dense LRU curve's pool sizes, a disk tier of `tier_gib` behind each.

    Returns:
        Columns capacity_tokens (the pool), pool_alone, with_tier (one LRU of pool + tier blocks) and floor
        (one LRU of the larger of the two: this engine's tier, which keeps what it promotes, hits at least
        that), as hit ratios (analysis/tier_plan.py).
    """
    trace = result.curve.trace
    pools = result.lru["capacity_tokens"].to_numpy() // trace.block_size
    tier = disk.tier_blocks(tier_gib, trace.block_size)
    frame = pd.DataFrame({"capacity_tokens": result.lru["capacity_tokens"], "pool_alone": result.lru["hit_ratio"]})
    frame["with_tier"] = result.curve.hit_tokens_at(pools + tier) / trace.input_tokens
    frame["floor"] = result.curve.hit_tokens_at(pools.clip(min=tier)) / trace.input_tokens
    return frame


def engine_tier_point(result: PlannerResult, tier_gib: float, disk: DiskModel, prefill_tokens_per_s: float) -> TierPoint:
    """A disk tier of `tier_gib` behind the running engine's pool: the planner's answer (`tier_plan.answer`).

    Raises:
        ValueError: a size, bandwidth or rate out of bounds.
    """
    service = ServiceModel(prefill_tokens_per_s=prefill_tokens_per_s)
    return tier_point(result.curve, TierSize(result.engine_capacity_tokens, tier_gib), disk, service)


def curve_frame(result: PlannerResult) -> pd.DataFrame:
    """Every evaluated point, one row each: the chart's markers and the CSV the page offers."""
    rows = []
    for point in result.analysis.curve:
        rows.append(
            {
                "policy": point.policy.value,
                "capacity_tokens": point.capacity_tokens,
                "capacity_blocks": point.capacity_blocks,
                "hit_ratio": point.hit_ratio,
                "miss_ratio": 1.0 - point.hit_ratio,
                "hit_tokens": point.hit_tokens,
                **{f"missed_{reason}": getattr(point.misses, reason) for reason in REASONS},
            }
        )
    return pd.DataFrame(rows)


class PlannerJob:
    """One analysis on a daemon thread; every field the page reads is behind one lock."""

    def __init__(self, load: Callable[[], Trace], request: PlannerRequest) -> None:
        self._load = load
        self._request = request
        self._lock = threading.Lock()
        self._state = JobState.RUNNING
        self._progress: Progress | None = None
        self._result: PlannerResult | None = None
        self._error: str | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capacity-planner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread; True once it has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def snapshot(self) -> JobSnapshot:
        with self._lock:
            return JobSnapshot(self._state, self._progress, self._result, self._error)

    def _tick(self, progress: Progress) -> None:
        if self._cancelled.is_set():
            raise JobCancelled
        with self._lock:
            self._progress = progress

    def _run(self) -> None:
        try:
            result = plan(self._load(), self._request, self._tick)
        except JobCancelled:
            self._finish(JobState.CANCELLED)
        except (TraceError, ValueError, OSError) as error:  # what an operator's input can cause: shown, not raised
            self._finish(JobState.FAILED, error=str(error))
        except Exception as error:  # a bug: the thread must not die silently, leaving the page polling forever
            logger.exception("capacity planner analysis failed")
            self._finish(JobState.FAILED, error=f"the analysis failed: {type(error).__name__}: {error}")
        else:
            self._finish(JobState.DONE, result=result)

    def _finish(self, state: JobState, *, result: PlannerResult | None = None, error: str | None = None) -> None:
        with self._lock:
            self._state, self._result, self._error = state, result, error


def served_shape(num_layers: int, num_kv_heads: int, head_dim: int, num_parameters: int, dtype_bytes: int) -> ModelShape:
    """A model's shape as a deployment serves it: its KV and its weights (`num_parameters`) in `dtype_bytes`."""
    return ModelShape(num_layers, num_kv_heads, head_dim, dtype_bytes, num_parameters * dtype_bytes)


def purchase_frame(needed: pd.DataFrame, engine_tokens: int, shape: ModelShape, accelerator: Accelerator) -> pd.DataFrame:
    """What each capacity of the "LRU needs" rows, and the running engine's pool, takes to buy.

    Args:
        needed: share_of_max, hit_ratio, capacity_tokens (`PlannerResult.needed`).
        engine_tokens: the running engine's pool, in tokens (the first row).
        shape: the model the cache serves.
        accelerator: what would hold it.

    Returns:
        Columns target, hit_ratio, capacity_tokens, kv_gib, accelerators, price_per_hour.

    Raises:
        ValueError: the weights leave no room for KV on that accelerator (`analysis.purchase.kv_room`).
    """
    targets = [("this engine's pool", math.nan, engine_tokens)]
    targets += [(f"{row.share_of_max:.0%} of the maximum", row.hit_ratio, int(row.capacity_tokens)) for row in needed.itertuples()]
    rows = []
    for target, hit_ratio, tokens in targets:
        bought = purchase(tokens, shape, accelerator)
        rows.append((target, hit_ratio, tokens, bought.kv_gib, bought.accelerators, bought.price_per_hour))
    return pd.DataFrame(rows, columns=["target", "hit_ratio", "capacity_tokens", "kv_gib", "accelerators", "price_per_hour"])
