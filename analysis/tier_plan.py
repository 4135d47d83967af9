"""What a disk tier behind the pool buys: the two-tier hit ratio at any (pool, tier) size read off the
one-pass LRU curve, the tier's load time against the prefill it saves, and the planner's answer.

    disk = DiskModel(kv_bytes_per_token=46_080, disk_gbps=2.0)
    point = tier_point(curve, TierSize(pool_tokens=16_384, tier_gib=8.0), disk, ServiceModel())
    answer(point)   # "add 8 GiB of disk tier to a pool of 16,384 tokens: hit ratio 0.210 -> 0.335, ..."

Hit ratio (analysis/tiers.py has the reasons and the direct simulation that checks them): an LRU pool of
P blocks and an LRU tier of D blocks that gives up the blocks it promotes hit exactly what one LRU cache
of P + D blocks hits; this engine's tier keeps a copy of what it promotes, which can only waste tier
slots, so it hits at least what one LRU cache of max(P, D) blocks hits and at most the P + D answer.
Both are read off the curve, for every (P, D) at once.

Cost: each block the tier serves is read at `disk_gbps` (GB/s, 10^9 bytes) before the request's prefill,
`kv_bytes_per_token x block_size` bytes, so it costs load time on the request's path; each token it
serves is a prompt token not computed, saving 1 / prefill_tokens_per_s seconds (the service model's
rate, measured on this engine unless given). The answer is net of the loads. Stores (demotions) go
through the engine's writer thread, off the step's critical path, and are not charged. A tier's blocks
are counted as the engine sizes its files: round(G x 2^30) // bytes per block.
"""

from __future__ import annotations

from dataclasses import dataclass

from analysis.stack_distance import LruCurve
from analysis.timed import ServiceModel
from analysis.trace import Trace
from engine.core.config import MAX_OFFLOAD_GIB

GIB = 2**30
SECONDS_PER_HOUR = 3600.0
DEFAULT_DISK_GBPS = 2.0  # a stated default, not a measurement: a local NVMe SSD's sustained read
MIN_DISK_GBPS, MAX_DISK_GBPS = 1e-3, 1e4  # operator-typed bounds: every derived time stays finite
MAX_KV_BYTES_PER_TOKEN = 2**30  # far above any model's (Llama-3-405B in fp32: about 2 MB)
# KV bytes per token of the model the service model's default prefill rate was measured on (SmolLM2-135M
# in float32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes), so the CLI's default loads and prefill match.
ENGINE_KV_BYTES_PER_TOKEN = 46_080


@dataclass(frozen=True)
class DiskModel:
    """What one block costs to keep in and read from the disk tier."""

    kv_bytes_per_token: int  # KV bytes of one token (`analysis.purchase.ModelShape.kv_bytes_per_token`)
    disk_gbps: float = DEFAULT_DISK_GBPS  # the tier's read bandwidth, in 10^9 bytes per second

    def __post_init__(self) -> None:
        if type(self.kv_bytes_per_token) is not int or not 1 <= self.kv_bytes_per_token <= MAX_KV_BYTES_PER_TOKEN:
            raise ValueError(f"KV bytes per token must be an integer in [1, {MAX_KV_BYTES_PER_TOKEN}]")
        if not MIN_DISK_GBPS <= self.disk_gbps <= MAX_DISK_GBPS:  # also refuses NaN
            raise ValueError(f"disk bandwidth must be in [{MIN_DISK_GBPS:g}, {MAX_DISK_GBPS:g}] GB/s, got {self.disk_gbps:g}")

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of `block_size` tokens (one tier slot)."""
        return self.kv_bytes_per_token * block_size

    def tier_blocks(self, tier_gib: float, block_size: int) -> int:
        """Blocks a tier of `tier_gib` GiB holds, as the engine sizes its files."""
        return round(tier_gib * GIB) // self.block_bytes(block_size)

    def load_seconds(self, blocks: int, block_size: int) -> float:
        """Seconds reading `blocks` blocks from the tier takes."""
        return blocks * self.block_bytes(block_size) / (self.disk_gbps * 1e9)


@dataclass(frozen=True)
class TierSize:
    """One configuration to evaluate: a pool and a disk tier behind it."""

    pool_tokens: int  # the pool's capacity (its blocks: pool_tokens // block_size)
    tier_gib: float  # the disk tier's size

    def __post_init__(self) -> None:
        if type(self.pool_tokens) is not int or self.pool_tokens < 0:
            raise ValueError(f"the pool must be an integer >= 0 tokens, got {self.pool_tokens}")
        if not 0 <= self.tier_gib <= MAX_OFFLOAD_GIB:
            raise ValueError(f"a disk tier must be in [0, {MAX_OFFLOAD_GIB}] GiB, got {self.tier_gib:g}")


@dataclass(frozen=True)
class TierConfig:
    """The analysis's two-tier rows: a disk tier of each size behind each of its capacities (LRU pool)."""

    sizes_gib: tuple[float, ...]  # disk tier sizes, in the order to report them
    disk: DiskModel  # bytes per block and read bandwidth
    simulate: bool = False  # also run this engine's tier directly at each point (analysis/tiers.py, one pass each)

    def __post_init__(self) -> None:
        if not self.sizes_gib:
            raise ValueError("name at least one disk tier size")
        if len(set(self.sizes_gib)) < len(self.sizes_gib):
            raise ValueError("a disk tier size is named twice")
        for gib in self.sizes_gib:
            TierSize(0, gib)  # its bounds


@dataclass(frozen=True)
class TierPoint:
    """A pool with a disk tier behind it, against the pool alone."""

    size: TierSize  # what was asked
    disk: DiskModel  # what its blocks weigh and how fast they are read
    pool_blocks: int  # P
    tier_blocks: int  # D
    input_tokens: int  # the trace's prompt tokens (the ratios' denominator)
    pool_hit_tokens: int  # the pool alone: one LRU of P
    hit_tokens: int  # pool + tier: one LRU of P + D (exact for a tier that gives up what it promotes)
    floor_hit_tokens: int  # one LRU of max(P, D): this engine's tier hits at least this
    loaded_blocks: int  # blocks the tier serves (references hit at P + D but not at P)
    prefill_s_saved: float  # the tier's hit tokens at the prefill rate
    load_s: float  # loaded_blocks read at the disk's bandwidth
    trace_hours: float | None  # the trace's time span (None: every request arrives at once)
    pool_alone_tokens: int  # the pool that hits as much with no tier: P + D blocks, in tokens
    pool_alone_kv_gib: float  # what that pool's KV takes (analysis/purchase.py prices it in accelerators)
    simulated_hit_tokens: int | None = None  # this engine's tier simulated directly (TierConfig.simulate)

    @property
    def tier_hit_tokens(self) -> int:
        """Prompt tokens the tier adds to the pool's."""
        return self.hit_tokens - self.pool_hit_tokens

    @property
    def net_prefill_s(self) -> float:
        """Prefill seconds saved, net of the tier's load time (negative: the disk is slower than prefill)."""
        return self.prefill_s_saved - self.load_s

    @property
    def net_prefill_s_per_trace_hour(self) -> float | None:
        return None if self.trace_hours is None else self.net_prefill_s / self.trace_hours

    def ratio(self, tokens: int) -> float:
        """`tokens` as a share of the trace's prompt tokens."""
        return tokens / self.input_tokens


def trace_hours(trace: Trace) -> float | None:
    """Hours from the trace's first arrival to its last; None when they all arrive at once."""
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) / SECONDS_PER_HOUR
    return span if span > 0 else None


def tier_point(curve: LruCurve, size: TierSize, disk: DiskModel, service: ServiceModel) -> TierPoint:
    """The two-tier answer at `size`, read off `curve` (see the module docstring)."""
    trace = curve.trace
    bs = trace.block_size
    pool, tier = size.pool_tokens // bs, disk.tier_blocks(size.tier_gib, bs)
    capacities = (pool, pool + tier, max(pool, tier))
    pool_hit, hit, floor = (int(t) for t in curve.hit_tokens_at(capacities))
    pool_refs, refs = (int(r) for r in curve.hit_references_at(capacities[:2]))
    loaded = refs - pool_refs
    return TierPoint(
        size,
        disk,
        pool,
        tier,
        trace.input_tokens,
        pool_hit,
        hit,
        floor,
        loaded,
        (hit - pool_hit) / service.prefill_tokens_per_s,
        disk.load_seconds(loaded, bs),
        trace_hours(trace),
        (pool + tier) * bs,
        (pool + tier) * disk.block_bytes(bs) / GIB,
    )


def answer(point: TierPoint) -> str:
    """The planner's sentence for `point`: the hit ratio with the tier, the prefill time it saves net of its
    loads (per hour of the trace when it has a time span), and the pool that would do as much alone."""
    hours = point.trace_hours
    unit, scale = ("per hour", 1 / hours) if hours else ("over the trace", 1.0)
    return (
        f"add {point.size.tier_gib:g} GiB of disk tier ({point.tier_blocks:,} blocks) to a pool of "
        f"{point.size.pool_tokens:,} tokens: hit ratio {point.ratio(point.pool_hit_tokens):.3f} -> "
        f"{point.ratio(point.hit_tokens):.3f} (this engine's tier, which keeps what it promotes: at least "
        f"{point.ratio(point.floor_hit_tokens):.3f}), {point.net_prefill_s * scale:,.0f} prefill seconds saved "
        f"{unit} ({point.prefill_s_saved * scale:,.0f} s of prefill less {point.load_s * scale:,.1f} s of tier "
        f"loads); the pool alone needs {point.pool_alone_tokens:,} tokens ({point.pool_alone_kv_gib:,.2f} GiB "
        f"of KV) for the same hit ratio"
    )
