"""Which tier of a pod would serve a prompt: its media walked fastest first, each going on where the last stopped.

A server with a second KV tier publishes its blocks under several media of one KV group: vLLM's pool as
"GPU" and its offloading connector's tiers as "CPU" and "STORAGE"; this project's engine its pool as
"CPU" (or "GPU") and its disk tier as "DISK". A block keeps its hash in every medium (the connector and
the engine's tier publish the pool's hashes), so a prompt's chain can be followed across them.

A server serves a prompt's prefix the way `tiered_reach` walks it:

    the pool's hit           fastest medium, from the prompt's start, as far as it holds the chain
    then the next tier       from where the pool's hit ended, as far as it holds the chain on
    then the next, ...

which is how vLLM's offloading connector looks up past the pool's hit (consecutive offloaded blocks from
the first block the pool missed) and how the engine's disk tier is searched (engine/core/kv_coordinator.py).
A tier that holds blocks further on, but not the block where the faster ones stopped, serves nothing.

Pure functions over `BlockGroup`s; the caller (`FleetIndex.route_tiers`) holds the index's lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleet.events import BlockHash
from fleet.held_blocks import BlockGroup

# Media by speed, fastest first; a medium not named here comes after them, by name.
TIER_ORDER = ("GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE")


def tier_rank(medium: str) -> tuple[int, str]:
    """A sort key putting media fastest first (TIER_ORDER, then unknown media by name)."""
    return (TIER_ORDER.index(medium), "") if medium in TIER_ORDER else (len(TIER_ORDER), medium)


@dataclass(frozen=True)
class TierServe:
    """What one medium of a pod would serve of a prompt, after the faster media."""

    medium: str  # the medium
    blocks: int  # blocks it serves
    tokens: int  # tokens it serves (beyond what the faster media serve)


def tiered_reach(groups: Iterable[tuple[str, BlockGroup]], prompt: bytes) -> tuple[TierServe, ...]:
    """Walk a packed prompt through one pod's media of one KV group, fastest first.

    Args:
        groups: (medium, the pod's group in it), in any order.
        prompt: the packed prompt, already cut to what the server may serve from cache.

    Returns:
        The media that serve some tokens, in serving order (empty when the first block misses everywhere).
    """
    served: list[TierServe] = []
    starts: tuple[tuple[BlockHash | None, int], ...] = ((None, 0),)  # where the next tier's walk begins
    for medium, group in sorted(groups, key=lambda pair: tier_rank(pair[0])):
        reach = group.walk_from(prompt, starts)
        if reach.blocks:
            served.append(TierServe(medium, reach.blocks, reach.tokens - starts[0][1]))
            starts = tuple((end, reach.tokens) for end in reach.ends)
    return tuple(served)


@dataclass(frozen=True)
class PodTierMatch:
    """How much of a prompt one pod would serve, tier by tier."""

    pod: str  # the pod
    served: tuple[TierServe, ...]  # the media that serve some of it, in serving order
    stale: bool  # whether the pod is stale (its answer may be out of date)

    @property
    def matched_tokens(self) -> int:
        """Tokens served from any tier: what the server would report as cached."""
        return sum(serve.tokens for serve in self.served)


@dataclass(frozen=True)
class TieredRoute:
    """A prompt walked through every pod's media of one KV group, most tokens served first."""

    num_prompt_tokens: int  # the prompt's length
    max_cached_tokens: int  # num_prompt_tokens - 1: the server recomputes the last token (vLLM's cap)
    group_idx: int  # the KV group walked
    matches: tuple[PodTierMatch, ...]  # every pod, most tokens served first, then by name
