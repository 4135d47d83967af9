"""KV groups: which layers share block tables, and how a sliding-window group hits.

Pure Python: no torch. A layer's attention kind is a string, "full" or "sliding:W" (a query at position
p sees keys in [p - W + 1, p]); `attention_window` is the one parser of it. Layers with full attention
form the "full" group; layers with sliding-window attention (one window W for all of them) form the
"sliding" group. Each group has its own block pool and its own tables, so the two kinds of state are
held and dropped independently.

A prefix hit in a model with sliding layers is not the same as ready window state. For a new request
the planner computes, together:

    h      hit position: tokens [0, h) have full-layer state (all-sliding models: window state ready)
    [s, e) the valid window-state range found in the sliding group (the deepest run of cached blocks)
    r      replay boundary: computation starts at r; tokens [r, h) are recomputed ("replayed")
    mode   (`ReplayMode`)
           NONE          nothing reused (h = r = 0)
           FULL          full-attention model: the hit is ready (r = h)
           READY         window state covers [h - W + 1, h): nothing replayed (r = h)
           EXACT         window state covers [r - W + 1, r) for the largest such block boundary r < h,
                         or r = 0: replaying [r, h) gives exactly a from-scratch result
           APPROXIMATE   only if the operator allows it and it is cheaper: replay the bounded suffix
                         [h - W - backtrack, h) without the state before it (approximately recovers it)

A fork child shares its parent's state whole, so its mode is the ready one of its model (FULL or READY);
that it came from a fork is its hit source, not a mode.

    positions:  0 ........ s ======== e ......... r ---------- h ~~~~~~ end
                (full-layer blocks [0, h) cached; sliding blocks [s, e) cached; [r, h) replayed;
                 [h, end) computed as usual)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core.arith import ceil_div
from engine.core.block import Block
from engine.core.chain_keys import chain_key
from engine.core.kv_tier import TierEntry

FULL = "full"
SLIDING = "sliding"
FULL_ATTENTION = "full"  # the attention kind of a full-attention layer
SLIDING_ATTENTION_PREFIX = "sliding:"  # a sliding layer's kind: this prefix and its window


class ReplayMode(enum.StrEnum):
    """How a new request's window state was recovered at its hit (the module docstring explains each)."""

    NONE = "none"  # nothing reused
    FULL = "full"  # full-attention model: the hit is ready
    READY = "ready"  # the window state at the hit was cached: nothing replayed
    EXACT = "exact"  # replayed from the last point with cached window state: exact
    APPROXIMATE = "approximate"  # replayed a bounded suffix without its window state: approximate


def attention_window(kind: str) -> int | None:
    """The window of one layer's attention kind: None for "full", W for "sliding:W" (W >= 1).

    Raises:
        ValueError: anything else.
    """
    if kind == FULL_ATTENTION:
        return None
    text = kind.removeprefix(SLIDING_ATTENTION_PREFIX)
    if text != kind and text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"attention kind must be 'full' or 'sliding:W' with W >= 1, got {kind!r}")


def sliding_attention(window: int) -> str:
    """The attention kind of a sliding layer with this window ("sliding:W")."""
    return f"{SLIDING_ATTENTION_PREFIX}{window}"


@dataclass(frozen=True)
class KVGroupSpec:
    name: str  # FULL or SLIDING
    window: int | None  # None for full attention
    layers: tuple[int, ...]  # model layer indices whose KV lives in this group


def kv_groups(attention_spec: tuple[str, ...]) -> tuple[KVGroupSpec, ...]:
    """Split a per-layer attention spec ("full" / "sliding:W") into KV groups, full group first."""
    windows = [attention_window(kind) for kind in attention_spec]
    full = tuple(i for i, window in enumerate(windows) if window is None)
    sliding = tuple(i for i, window in enumerate(windows) if window is not None)
    distinct = {windows[i] for i in sliding}
    if len(distinct) > 1:
        raise ValueError(f"sliding layers with different windows {sorted(distinct)} are not supported")
    groups = []
    if full:
        groups.append(KVGroupSpec(FULL, None, full))
    if sliding:
        groups.append(KVGroupSpec(SLIDING, distinct.pop(), sliding))
    return tuple(groups)


@dataclass(frozen=True)
class WindowPolicy:
    """How sliding-window state is kept and recovered."""

    backtrack: int = 0  # extra tokens of window state kept when caching (hits a little earlier stay ready)
    allow_approximate: bool = False  # may replay a bounded suffix without its preceding state


@dataclass(frozen=True, slots=True)
class WindowHit:
    """Where a hit in a model with sliding layers lands, in tokens (see the module docstring)."""

    h: int  # hit position
    s: int  # start of the valid window-state range found
    e: int  # its end
    r: int  # replay boundary: computation starts here
    mode: ReplayMode


NO_HIT = WindowHit(h=0, s=0, e=0, r=0, mode=ReplayMode.NONE)


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The hit cap: the most leading full blocks a context of `num_tokens` tokens may take from the
    prefix index. Its last token is always computed, so that the forward produces logits to sample from."""
    return (num_tokens - 1) // block_size


@dataclass(frozen=True)
class HitPlan:
    """What a new request reuses, where its computation starts, and why."""

    h: int  # hit position: tokens [0, h) have full-layer state (all-sliding models: ready window state)
    s: int  # valid window-state range [s, e) found in the sliding group
    e: int
    r: int  # replay boundary: the first chunk starts here; [r, h) is recomputed
    mode: ReplayMode
    # the namespace root (with the request's salt) its keys hang from, resolved once for the admission
    # (engine/core/namespace.py): the new tables hang from it, and nothing derives it again
    root_key: bytes = field(repr=False)
    chain_keys: list[bytes] = field(repr=False)  # keys of the prompt's full blocks up to the hit cap
    full_hits: list[Block] = field(default_factory=list, repr=False)  # the full group's pool blocks from 0 on
    # the disk tier's entries for the full group's blocks after `full_hits`, up to h (engine/core/kv_tier.py)
    tier_hits: list[TierEntry] = field(default_factory=list, repr=False)
    sliding_offset: int = 0  # logical block where the sliding table starts
    sliding_hits: list[Block] = field(default_factory=list, repr=False)  # sliding blocks from the offset to r

    @property
    def replayed_tokens(self) -> int:
        return self.h - self.r

    @property
    def tier_tokens(self) -> int:
        """Hit tokens the disk tier holds (promoted into the pool before the forward)."""
        return sum(len(entry.token_ids) for entry in self.tier_hits)


def chain_keys_of(token_ids: list[int], root_key: bytes, block_size: int, num_blocks: int) -> list[bytes]:
    """Chained keys of the first `num_blocks` full blocks of `token_ids`."""
    keys, parent = [], root_key
    for start in range(0, num_blocks * block_size, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def present_runs(present: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [first, last + 1) of consecutive True entries, in order."""
    runs, start = [], None
    for i, here in enumerate(present):
        if here and start is None:
            start = i
        elif not here and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(present)))
    return runs


def window_ready_at(run: tuple[int, int], window: int, block_size: int) -> bool:
    """True when the run of cached sliding blocks holds the window of the token right after it."""
    first, end = run
    needed_first = max(0, end * block_size - window + 1) // block_size
    return first <= needed_first


def plan_window_hit(
    h_blocks: int,
    present: list[bool],
    window: int,
    block_size: int,
    policy: WindowPolicy,
) -> WindowHit:
    """Choose h, [s, e), r and the mode for a hybrid model (see module docstring).

    Args:
        h_blocks: full-group hit length in blocks.
        present: for each logical block < h_blocks, whether its sliding state is cached.
        window: W.
        block_size: tokens per block.
        policy: backtracking allowance and whether approximate replay is allowed.
    """
    h = h_blocks * block_size
    if h == 0:
        return NO_HIT
    runs = present_runs(present[:h_blocks])
    s = e = 0
    if runs:
        s, e = runs[-1][0] * block_size, runs[-1][1] * block_size
    if runs and runs[-1][1] == h_blocks and window_ready_at(runs[-1], window, block_size):
        return WindowHit(h=h, s=s, e=e, r=h, mode=ReplayMode.READY)
    exact_r = max((end * block_size for first, end in runs if window_ready_at((first, end), window, block_size)), default=0)
    approx_r = ceil_div(max(0, h - window - policy.backtrack), block_size) * block_size  # bounded: h - r <= W + backtrack
    if policy.allow_approximate and approx_r > exact_r:
        return WindowHit(h=h, s=s, e=e, r=approx_r, mode=ReplayMode.APPROXIMATE)
    return WindowHit(h=h, s=s, e=e, r=exact_r, mode=ReplayMode.EXACT)


def plan_sliding_only_hit(present: list[bool], window: int, block_size: int) -> WindowHit:
    """For an all-sliding model: the deepest block boundary whose window state is cached is the hit."""
    for first, end in reversed(present_runs(present)):
        if window_ready_at((first, end), window, block_size):
            h = end * block_size
            return WindowHit(h=h, s=first * block_size, e=h, r=h, mode=ReplayMode.READY)
    return NO_HIT
