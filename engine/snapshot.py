"""Immutable views of engine state, safe to hand to other threads (console, storage, CLI).

A snapshot is taken under the engine lock between steps, so every number in it belongs to the same
moment: block states, reference counts, holders and tables agree with one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.request import HitSource, Request, RequestStatus


class RequestView(NamedTuple):
    """One request as of one moment (a NamedTuple: the engine builds one per changed request per step,
    and a frozen dataclass cost three times as much to build)."""

    request_id: str
    parent_id: str | None
    status: str
    retain: bool
    salt: str | None
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_prompt_tokens: int  # context length before generation (a fork's inherited tokens included)
    num_computed_tokens: int  # tokens whose KV the request's blocks hold now
    cached_tokens: int  # hit position at first schedule
    computed_tokens: int  # prefill tokens run through the model (recomputation after preemption included)
    hit_source: str
    cow_copies: int
    preemptions: int
    finish_reason: str | None
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    block_tables: dict[str, tuple[int, ...]]  # per KV group ("full", "sliding"): physical blocks held
    max_new_tokens: int
    window_start: int
    window_end: int
    replay_from: int
    replay_mode: str
    replayed_tokens: int
    replay_divergence: dict[str, float] | None

    # The sliding-window vocabulary of engine/kv_groups.py (and of the stored request rows).
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
    def block_table(self) -> tuple[int, ...]:
        """The first group's table (the full group when the model has full-attention layers)."""
        return next(iter(self.block_tables.values()), ())

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_s(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None:
            return None
        return self.finish_time - self.first_token_time

    @staticmethod
    def of(request: Request, block_tables: dict[str, list[int]]) -> RequestView:
        # Built positionally, in field order (tests/test_engine.py checks every field by name): the
        # engine builds one per changed request per step, and keywords cost three times as much.
        return _new_view(
            RequestView,
            (
                request.request_id,
                request.parent_id,
                _STATUS_VALUES[request.status],
                request.retain,
                request.salt,
                request.prompt_token_ids,  # a tuple already
                tuple(request.output_token_ids),
                len(request.prompt_token_ids),
                request.num_computed_tokens,
                request.cached_tokens,
                request.computed_tokens,
                _HIT_SOURCE_VALUES[request.hit_source],
                request.cow_copies,
                request.preemptions,
                request.finish_reason,
                request.arrival_time,
                request.first_scheduled_time,
                request.first_token_time,
                request.finish_time,
                {group: tuple(ids) for group, ids in block_tables.items()},
                request.sampling.max_new_tokens,
                request.window_start,
                request.window_end,
                request.replay_from,
                request.replay_mode,
                request.replayed_tokens,
                request.replay_divergence,
            ),
        )


_new_view = tuple.__new__
# Enum `.value` is a slow descriptor; views carry the plain strings.
_STATUS_VALUES = {status: status.value for status in RequestStatus}
_HIT_SOURCE_VALUES = {source: source.value for source in HitSource}


@dataclass(frozen=True, slots=True)
class BlockView:
    block_id: int  # unique within its group's pool
    group: str  # KV group: "full" (full-attention layers) or "sliding" (sliding-window layers)
    state: str  # "free", "evictable" (cached, unreferenced) or "referenced"
    ref_count: int
    num_tokens: int
    token_ids: tuple[int, ...]
    key: str | None  # hex, while in the prefix index
    parent_key: str | None
    start_pos: int
    created_at: float
    last_used: float
    hit_count: int
    holders: tuple[str, ...]  # request ids whose tables point here


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One KV group's pool (full-attention layers or sliding-window layers)."""

    name: str
    window: int | None
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    evictable_blocks: int
    used_blocks: int
    logical_blocks: int
    evictions: int
    cow_copies: int
    window_released_blocks: int  # sliding groups: blocks released because they left the window


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    block_size: int
    free_blocks: int
    cached_blocks: int  # keyed blocks (referenced or evictable)
    evictable_blocks: int
    used_blocks: int  # referenced blocks
    logical_blocks: int  # table entries over all live tables
    evictions: int
    cow_copies: int
    preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    steps: int
    num_waiting: int
    num_running: int
    num_retained: int
    groups: tuple[GroupStats, ...] = ()  # the same counters per KV group

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def sharing_ratio(self) -> float:
        """Logical blocks over physical referenced blocks (1.0 = no sharing)."""
        return self.logical_blocks / self.used_blocks if self.used_blocks else 1.0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    time: float
    stats: PoolStats
    blocks: tuple[BlockView, ...]
    requests: tuple[RequestView, ...]
