"""The disk KV tier in a miss diagnosis (analysis/why.py): which prompt tokens were served from disk, and
what the tier did with a missed block after the pool evicted it.

Pure computation over what the history holds (storage/read/tier_history.py reads it):

    served from disk   a request's `disk_cached_tokens` (of its cached tokens, those promoted from the tier)
                       and the blocks its PROMOTE events read, with the token range they cover
    both tiers         the missed block was evicted from the pool, then evicted from the tier (lru, corrupt)
                       or dropped by it (full, writer) before the request looked it up: a miss a larger
                       tier would have saved
    still on disk      demoted but not evicted: the tier held it, not ready yet (its write had not
                       completed) when the request looked it up

A history without tier moves (no tier, or an eviction the tier is never offered: reset, window) gives
neither: the diagnosis reads as it did before the tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Promoted(Protocol):
    """One block a request read from the tier (storage/read/tier_history.py's `Promotion`)."""

    block: int
    key_hex: str
    slot: int
    step: int
    at: float


class Fate(Protocol):
    """What the tier did with a block after a pool eviction (storage/read/tier_history.py's `TierFate`)."""

    demoted_at: float | None
    demoted_step: int | None
    slot: int | None
    gone_kind: str | None  # "tier_evict" | "tier_drop", None while the tier still held it
    gone_at: float | None
    gone_step: int | None
    gone_reason: str | None


@dataclass(frozen=True)
class TierLookups:
    """How a diagnosis reads the tier's history."""

    promotions: Callable[[str, str], Sequence[Promoted]]  # (run_id, request_id) -> its promoted blocks, in table order
    fate: Callable[[str, str, float, float], Fate | None]  # (run_id, key hex, pool eviction time, lookup time)


def served_from_disk(request: Any, lookups: TierLookups | None) -> dict[str, Any] | None:
    """The request's tokens served from disk: `tokens`, `memory_tokens` (the rest of its cached tokens),
    the token range [`start`, `end`) and the pool `blocks` (and tier `slots`) its promotions read into;
    None when the tier served none of them.

    The range comes from the promoted keys' places among the prompt's chain keys once the request has
    finished (`block_keys`), else from the hit's shape (the pool's blocks first, then the tier's).
    """
    disk = int(getattr(request, "disk_cached_tokens", 0) or 0)
    if disk <= 0:
        return None
    cached = min(request.cached_tokens, request.prompt_tokens)
    promoted = list(lookups.promotions(request.run_id, request.request_id)) if lookups is not None else []
    start, end = max(0, cached - disk), cached
    keys = request.block_keys
    if keys and promoted:
        chain = [keys[i : i + 16].hex() for i in range(0, len(keys), 16)]
        places = [chain.index(p.key_hex) for p in promoted if p.key_hex in chain]
        if places:
            start, end = min(places) * request.block_size, (max(places) + 1) * request.block_size
    return {
        "tokens": disk,
        "memory_tokens": cached - disk,
        "start": start,
        "end": end,
        "blocks": [p.block for p in promoted],
        "slots": [p.slot for p in promoted],
        "step": promoted[0].step if promoted else None,
        "at": promoted[0].at if promoted else None,
    }


def tier_after_eviction(lookups: TierLookups | None, run_id: str, key_hex: str, evicted_at: float,
                        before: float) -> dict[str, Any] | None:  # fmt: skip
    """The tier's part in a pool eviction's miss: `lost` (evicted from both tiers, or dropped by the tier),
    when it was demoted (`demoted_at`, `demoted_step`, `slot`) and when and why the tier lost it (`kind`,
    `at`, `step`, `reason`); None when the history has no tier move of the key in between."""
    fate = lookups.fate(run_id, key_hex, evicted_at, before) if lookups is not None else None
    if fate is None:
        return None
    return {
        "lost": fate.gone_kind is not None,
        "pool_evicted_at": evicted_at,
        "demoted_at": fate.demoted_at,
        "demoted_step": fate.demoted_step,
        "slot": fate.slot,
        "kind": fate.gone_kind,
        "at": fate.gone_at,
        "step": fate.gone_step,
        "reason": fate.gone_reason,
    }


def still_on_disk_note(tier: dict[str, Any]) -> str:
    """The note of a missed block the tier still held (demoted, neither evicted nor dropped)."""
    return (f"it was demoted to disk at step {tier['demoted_step']} (tier slot {tier['slot']}) and was still there, "
            "but its write had not completed when this request looked it up")  # fmt: skip


def tier_words(tier: dict[str, Any], clock: Callable[[float], str]) -> str:
    """A lost block's two evictions in words: when the pool evicted it, when and why the tier lost it (times
    shown by `clock`)."""
    at, step, reason = clock(tier["at"]), tier["step"], tier["reason"]
    if tier["kind"] != "tier_drop":
        gone = (f"demoted to disk at step {tier['demoted_step']} (tier slot {tier['slot']}), evicted from it at step "
                f"{step}, {at} ({reason})")  # fmt: skip
    elif tier["demoted_at"] is None:
        gone = f"dropped by the disk tier at step {step}, {at} ({reason}: it was never stored)"
    else:
        gone = f"demoted at step {tier['demoted_step']}, dropped at step {step}, {at} ({reason}: its write failed)"
    return f"evicted from both tiers: from the pool at {clock(tier['pool_evicted_at'])}, then {gone}"
