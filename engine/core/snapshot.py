"""Immutable views of engine state, safe to hand to other threads (console, storage, CLI), and the
functions that assemble them.

A snapshot is taken under the engine lock between steps, so every number in it belongs to the same
moment: block states, reference counts, holders and tables agree with one another. A `RequestView`'s
status is a `RequestStatus` and a `BlockView`'s state a `BlockState`, string enums that compare equal to
their values (which the history stores); its hit source and replay mode are the enums' values.

A view answers what the console asks of a request (`releasable`, `holds_blocks`, `is_final`) with the
engine's own rules (engine/core/request.py), so no page re-derives them from the status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple, Sequence

from engine.core.block_pool import BlockState
from engine.core.kv_tier import TierStats
from engine.core.request import Request, RequestStatus, TokenLogprobs, can_release
from engine.core.tier_view import TierView

if TYPE_CHECKING:
    from engine.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from engine.core.kv_coordinator import KVCoordinator
    from engine.core.scheduler import Scheduler


class RequestView(NamedTuple):
    """One request as of one moment (a NamedTuple: the engine builds one per changed request per step)."""

    request_id: str
    parent_id: str | None  # set for forks
    status: RequestStatus  # (a plain value once decoded from the history's wire; the answers below accept both)
    retain: bool  # keeps its blocks after finishing, as a fork base
    salt: str | None  # tenant salt
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_prompt_tokens: int  # context length before generation (a fork's inherited tokens included)
    num_computed_tokens: int  # tokens whose KV the request's blocks hold now
    cached_tokens: int  # hit position at first schedule
    computed_tokens: int  # prefill tokens run through the model (recomputation after preemption included)
    hit_source: str  # a HitSource value
    cow_copies: int  # copy-on-write copies its chunks made
    preemptions: int
    finish_reason: str | None  # "length", "eos", "stop", or why it was rejected
    arrival_time: float  # epoch s
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    block_tables: dict[str, tuple[int, ...]]  # per KV group ("full", "sliding"): physical blocks held
    max_new_tokens: int
    window_start: int  # s: valid window-state range [s, e) found at admission
    window_end: int  # e
    replay_from: int  # r: computation started here
    replay_mode: str  # a ReplayMode value
    replayed_tokens: int  # h - r
    replay_divergence: dict[str, float] | None  # engine/runner/verify.py's Divergence, when verified
    block_keys: bytes | None  # the prompt's full-block chain keys, 16 bytes each, once finished (PromptKeys)
    content_keys: bytes | None  # the same blocks' namespace-free keys, once finished
    # One per output token when its sampling asked for logprobs (`SamplingParams.logprobs`), else None.
    output_logprobs: tuple[TokenLogprobs, ...] | None = None
    disk_cached_tokens: int = 0  # of `cached_tokens`, those read from the disk tier (the rest: the pool's memory)

    # The sliding-window vocabulary of engine/core/kv_groups.py (and of the stored request rows).
    @property
    def h(self) -> int:
        """Hit position."""
        return self.cached_tokens

    @property
    def s(self) -> int:
        """Start of the valid window-state range found at admission."""
        return self.window_start

    @property
    def e(self) -> int:
        """End of the valid window-state range."""
        return self.window_end

    @property
    def r(self) -> int:
        """Replay boundary: computation started here."""
        return self.replay_from

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Where its cached prompt tokens came from: the pool's memory, or the disk tier (they sum to
        `cached_tokens`)."""
        return {"memory": self.cached_tokens - self.disk_cached_tokens, "disk": self.disk_cached_tokens}

    @property
    def block_table(self) -> tuple[int, ...]:
        """The first group's table (the full group when the model has full-attention layers)."""
        return next(iter(self.block_tables.values()), ())

    # What the console asks, answered by the engine's rules (engine/core/request.py).
    @property
    def releasable(self) -> bool:
        """Whether `Engine.release` accepts it: retained, or waiting or running with retain set."""
        return can_release(RequestStatus(self.status), self.retain)

    @property
    def holds_blocks(self) -> bool:
        """Whether its status always holds KV blocks (running or retained): a fork may share them."""
        return RequestStatus(self.status).holds_blocks

    @property
    def is_final(self) -> bool:
        """Whether it will never run again (retained, finished, released, rejected, failed, aborted)."""
        return RequestStatus(self.status).is_final

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_s(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None:
            return None
        return self.finish_time - self.first_token_time

    @staticmethod
    def of(request: Request, block_tables: Mapping[str, Sequence[int]]) -> RequestView:
        return RequestView(
            request_id=request.request_id,
            parent_id=request.parent_id,
            status=request.status,
            retain=request.retain,
            salt=request.salt,
            prompt_token_ids=request.prompt_token_ids,  # a tuple already: shared, not copied
            output_token_ids=tuple(request.output_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            cached_tokens=request.cached_tokens,
            computed_tokens=request.computed_tokens,
            hit_source=request.hit_source.value,
            cow_copies=request.cow_copies,
            preemptions=request.preemptions,
            finish_reason=request.finish_reason,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            block_tables={group: tuple(ids) for group, ids in block_tables.items()},  # tuples stay as they are
            max_new_tokens=request.sampling.max_new_tokens,
            window_start=request.window_start,
            window_end=request.window_end,
            replay_from=request.replay_from,
            replay_mode=request.replay_mode.value,
            replayed_tokens=request.replayed_tokens,
            replay_divergence=request.replay_divergence,
            block_keys=None if request.prompt_keys is None else request.prompt_keys.chain,
            content_keys=None if request.prompt_keys is None else request.prompt_keys.content,
            output_logprobs=None if request.sampling.logprobs is None else tuple(request.output_logprobs),
            disk_cached_tokens=request.disk_cached_tokens,
        )


def newest_first(views: Iterable[RequestView]) -> list[RequestView]:
    """`views` ordered by arrival, newest first (the order in which the console lists requests)."""
    return sorted(views, key=lambda view: view.arrival_time, reverse=True)


@dataclass(frozen=True, slots=True)
class BlockView:
    block_id: int  # unique within its group's pool
    group: str  # KV group: "full" (full-attention layers) or "sliding" (sliding-window layers)
    state: BlockState  # free, evictable (cached, unreferenced) or referenced
    ref_count: int  # block-table entries pointing here
    num_tokens: int  # filled slots
    token_ids: tuple[int, ...]
    key: str | None  # hex, while in the prefix index
    parent_key: str | None  # hex: the key its chain hangs from, while in the prefix index
    start_pos: int  # context position of slot 0
    created_at: float  # when it was last handed out (epoch s)
    last_used: float  # last allocation, prefix hit or release (epoch s)
    hit_count: int  # prefix hits since it was handed out
    holders: tuple[str, ...]  # request ids whose tables point here


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One KV group's pool (full-attention layers or sliding-window layers)."""

    name: str  # "full" or "sliding"
    window: int | None  # None for full attention
    num_blocks: int
    free_blocks: int  # unreferenced, uncached
    cached_blocks: int  # keyed blocks (referenced or evictable)
    evictable_blocks: int  # cached and unreferenced
    used_blocks: int  # referenced blocks
    logical_blocks: int  # table entries over all live tables
    evictions: int  # keys dropped since the engine started (LRU, reset, window, parent evicted)
    cow_copies: int
    window_released_blocks: int  # sliding groups: blocks released because they left the window
    window_evictions: int  # of `evictions`, keys dropped because their state left the window (not capacity)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The counters of `GroupStats` summed over the KV groups, and the scheduler's."""

    num_blocks: int
    block_size: int
    free_blocks: int
    cached_blocks: int  # keyed blocks (referenced or evictable)
    evictable_blocks: int
    used_blocks: int  # referenced blocks
    logical_blocks: int  # table entries over all live tables
    evictions: int  # every key dropped: capacity, reset, window and their chained children
    window_evictions: int  # of which dropped because their state left a sliding window (not for capacity)
    cow_copies: int
    preemptions: int
    # Reuse in tokens (engine/core/scheduler.py's ReuseCounters explains each).
    prefix_query_tokens: int  # prompt tokens of new requests looked up in the prefix index (vLLM's queries)
    prefix_hit_tokens: int  # of which reused from the index, not computed (vLLM's hits)
    replayed_tokens: int  # hit tokens recomputed to rebuild sliding-window state (not counted as hits)
    fork_query_tokens: int  # context tokens of fork children
    fork_shared_tokens: int  # of which shared from their parents, not computed
    preempted_query_tokens: int  # context tokens of preempted requests looked up again
    preempted_hit_tokens: int  # of which found in the cache (not counted as prefix hits)
    steps: int  # engine steps run
    num_waiting: int
    num_running: int
    num_retained: int
    groups: tuple[GroupStats, ...] = ()  # the same counters per KV group
    tier_hit_tokens: int = 0  # of `prefix_hit_tokens`, those read from the disk tier (the rest: the pool's memory)
    tier: TierStats | None = None  # the disk tier's counters (engine/core/kv_tier.py); None without one

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def sharing_ratio(self) -> float:
        """Logical blocks over physical referenced blocks (1.0 = no sharing)."""
        return self.logical_blocks / self.used_blocks if self.used_blocks else 1.0

    @property
    def prefix_hit_rate(self) -> float:
        """vLLM's prefix-cache hit rate: prefix-index hit tokens over looked-up prompt tokens (forks and
        re-admissions after preemption excluded)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def fork_share_rate(self) -> float:
        """Context tokens fork children shared from their parents over their context tokens."""
        return self.fork_shared_tokens / self.fork_query_tokens if self.fork_query_tokens else 0.0

    @property
    def tokens_saved(self) -> int:
        """Prompt tokens not computed thanks to reuse: prefix hits (replayed tokens excluded) and fork
        sharing. A preempted request's reuse of its own blocks is not a saving (it computed them once)."""
        return self.prefix_hit_tokens + self.fork_shared_tokens


@dataclass(frozen=True, slots=True)
class ResetResult:
    """What a prefix-cache reset did (`Engine.reset_cache`)."""

    dropped_blocks: int  # unreferenced cached blocks evicted
    kept_blocks: int  # cached blocks kept because running or retained requests hold them

    @property
    def ok(self) -> bool:
        """True when the prefix cache is now empty."""
        return self.kept_blocks == 0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    time: float  # when it was taken (epoch s)
    stats: PoolStats
    blocks: tuple[BlockView, ...]  # every block of every group, group by group in block-id order
    requests: tuple[RequestView, ...]  # every request the engine has seen
    tier: TierView | None = None  # the disk tier's newest blocks and the pool blocks promoted from it; None without one


# ---------------------------------------------------------------------------------------------- assembly
def group_stats(manager: SingleTypeKVCacheManager) -> GroupStats:
    pool = manager.pool
    return GroupStats(
        name=pool.group,
        window=manager.window,
        num_blocks=pool.num_blocks,
        free_blocks=pool.num_free,
        cached_blocks=pool.num_cached,
        evictable_blocks=pool.num_evictable,
        used_blocks=pool.num_blocks - pool.num_allocatable,
        logical_blocks=manager.num_logical_blocks(),
        evictions=pool.num_evictions,
        cow_copies=manager.num_cow_copies,
        window_released_blocks=manager.num_window_released,
        window_evictions=manager.num_window_evictions,
    )


def pool_stats(kv: KVCoordinator, scheduler: Scheduler, num_retained: int, steps: int) -> PoolStats:
    """Every group's counters, their sums, and the scheduler's counters, as of now (`num_retained`: the
    engine's count; nothing here walks the requests)."""
    groups = tuple(group_stats(manager) for manager in kv.managers)

    def total(name: str) -> int:
        return sum(getattr(group, name) for group in groups)

    return PoolStats(
        num_blocks=total("num_blocks"),
        block_size=kv.block_size,
        free_blocks=total("free_blocks"),
        cached_blocks=total("cached_blocks"),
        evictable_blocks=total("evictable_blocks"),
        used_blocks=total("used_blocks"),
        logical_blocks=total("logical_blocks"),
        evictions=total("evictions"),
        window_evictions=total("window_evictions"),
        cow_copies=total("cow_copies"),
        preemptions=scheduler.num_preemptions,
        prefix_query_tokens=scheduler.counters.prefix_query_tokens,
        prefix_hit_tokens=scheduler.counters.prefix_hit_tokens,
        replayed_tokens=scheduler.counters.replayed_tokens,
        fork_query_tokens=scheduler.counters.fork_query_tokens,
        fork_shared_tokens=scheduler.counters.fork_shared_tokens,
        preempted_query_tokens=scheduler.counters.preempted_query_tokens,
        preempted_hit_tokens=scheduler.counters.preempted_hit_tokens,
        steps=steps,
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        num_retained=num_retained,
        groups=groups,
        tier_hit_tokens=scheduler.counters.tier_hit_tokens,
        tier=None if kv.tier is None else kv.tier.stats(),
    )


def block_views(kv: KVCoordinator) -> tuple[BlockView, ...]:
    """Every block of every group with its holders, group by group."""
    views = []
    for manager in kv.managers:
        pool, holders = manager.pool, manager.holders()
        for b in pool.blocks:
            views.append(
                BlockView(
                    block_id=b.block_id,
                    group=pool.group,
                    state=pool.state_of(b),
                    ref_count=b.ref_count,
                    num_tokens=len(b.token_ids),
                    token_ids=tuple(b.token_ids),
                    key=b.key.hex() if b.key else None,
                    parent_key=b.parent_key.hex() if b.parent_key else None,
                    start_pos=b.start_pos,
                    created_at=b.created_at,
                    last_used=b.last_used,
                    hit_count=b.hit_count,
                    holders=tuple(holders.get(b.block_id, ())),
                )
            )
    return tuple(views)
