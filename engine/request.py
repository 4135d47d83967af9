"""Requests: what an operator asked for, and what the engine did with it.

`Request` is the engine's mutable record (owned by the engine thread). `RequestView` is the immutable
copy handed to other threads (console, storage, CLI).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.config import MAX_NEW_TOKENS


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks (or was preempted and gave them back)
    RUNNING = "running"  # holds blocks, is prefilling or decoding
    RETAINED = "retained"  # finished but kept as a fork base; holds its blocks until released
    FINISHED = "finished"  # done; its blocks were released
    RELEASED = "released"  # a retained request that an operator released
    REJECTED = "rejected"  # refused (too large for the pool, ...); never held blocks
    FAILED = "failed"  # stopped by an error of its own (non-finite logits); its blocks were freed
    ABORTED = "aborted"  # stopped unfinished because its engine was shut down (a restart); blocks freed


class HitSource(str, enum.Enum):
    NONE = "none"  # nothing reused; the whole context was computed
    PREFIX = "prefix"  # leading blocks came from the prefix index
    FORK = "fork"  # the block table was shared from a parent request


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # per-request generator seed for temperature > 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise ValueError(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Request:
    """The engine's record of one request. Mutated only by the engine thread."""

    request_id: str
    prompt_token_ids: tuple[int, ...]  # context before generation (a fork's inherited tokens included); fixed
    sampling: SamplingParams
    parent_id: str | None = None  # set for forks
    retain: bool = False  # keep blocks after finishing, as a fork base
    salt: str | None = None  # tenant salt folded into the cache namespace
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    cached_tokens: int = 0  # hit position: tokens reused at first schedule
    computed_tokens: int = 0  # prefill tokens actually run through the model
    hit_source: HitSource = HitSource.NONE
    cow_copies: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    final_block_tables: dict[str, list[int]] = field(default_factory=dict)  # per KV group, as it finished
    # Sliding-window hit accounting (see engine/kv_groups.py): the hit position h is `cached_tokens`.
    window_start: int = 0  # s: valid window-state range [s, e) found at admission
    window_end: int = 0  # e
    replay_from: int = 0  # r: computation started here; [r, h) was replayed
    replay_mode: str = "none"  # none | full | ready | exact | approximate | fork
    replayed_tokens: int = 0  # h - r
    replay_divergence: dict[str, float] | None = None
    # False while the request's KV derives from an approximate replay (its own or a fork parent's):
    # such state is never offered to the prefix index, so no later request can hit it.
    cacheable: bool = True  # approximate replays with verify on (engine/verify.py)
    prefilling: bool = True  # no token sampled since the last admission (fresh or after preemption)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)  # views share it instead of copying it

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        """Context length: prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
