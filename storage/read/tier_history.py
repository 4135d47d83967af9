"""The disk KV tier read back: a run's tier counts, a block key's moves between the tiers, a request's
promotions, and what the tier did with a block after the pool evicted it (for the miss diagnosis).

Every move is a `tier_moves` row (storage/schema.py; one per block a DEMOTE, PROMOTE, TIER_EVICT or
TIER_DROP event moved); a request's promotions come from its PROMOTE events (their request index). Every
result is bounded: counts are one row per (kind, reason), lists stop at their `limit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pandas as pd
from sqlalchemy import func, select

from storage.read.access import Readable, connect, frame
from storage.schema import EVENTS, TIER_MOVES

# EventKind values of the tier's events (engine/core/events.py).
DEMOTE, PROMOTE, TIER_EVICT, TIER_DROP = "demote", "promote", "tier_evict", "tier_drop"
MAX_MOVES = 1_000  # moves one key query returns at most (the newest)
MAX_KEYS = 256  # keys one query may ask about
MAX_PROMOTIONS = 256  # PROMOTE events of one request read at most
MAX_FATE_MOVES = 64  # moves of one key read after a pool eviction
MOVE_COLUMNS = ("id", "key_hex", "step", "time", "kind", "block_id", "request_id", "slot", "reason", "tokens", "move")


@dataclass(frozen=True)
class TierCounts:
    """A run's tier moves, counted from its `tier_moves` rows."""

    demotions: int = 0  # blocks whose store was planned (DEMOTE): written unless later dropped by the writer
    promotions: int = 0  # blocks read back into the pool (PROMOTE)
    promoted_tokens: int = 0  # their tokens: prompt tokens served from disk
    evictions: dict[str, int] = field(default_factory=dict)  # blocks the tier gave up, by TierReason (lru, corrupt)
    drops: dict[str, int] = field(default_factory=dict)  # evicted blocks it did not keep, by TierReason (full, writer)

    @property
    def stores(self) -> int:
        """Demotions the writer completed (the engine's TierStats.stores once its writer is idle)."""
        return self.demotions - self.drops.get("writer", 0)


def tier_counts(db: Readable, run_id: str) -> TierCounts:
    """The run's demotions, promotions (and their tokens), tier evictions and drops by reason."""
    statement = (
        select(TIER_MOVES.c.kind, TIER_MOVES.c.reason, func.count(), func.sum(TIER_MOVES.c.tokens))
        .where(TIER_MOVES.c.run_id == run_id)
        .group_by(TIER_MOVES.c.kind, TIER_MOVES.c.reason)
    )
    with connect(db) as connection:
        rows = connection.execute(statement).all()
    counts: dict[str, int] = {}
    evictions: dict[str, int] = {}
    drops: dict[str, int] = {}
    promoted_tokens = 0
    for kind, reason, count, tokens in rows:
        counts[kind] = counts.get(kind, 0) + count
        if kind == PROMOTE:
            promoted_tokens += int(tokens or 0)
        elif kind == TIER_EVICT:
            evictions[reason] = evictions.get(reason, 0) + count
        elif kind == TIER_DROP:
            drops[reason] = drops.get(reason, 0) + count
    return TierCounts(counts.get(DEMOTE, 0), counts.get(PROMOTE, 0), promoted_tokens, evictions, drops)


def key_moves(db: Readable, run_id: str, keys: Sequence[str], limit: int = MAX_MOVES) -> pd.DataFrame:
    """The tier moves of these block keys in the run, oldest first (the newest `limit`), each in words
    (`move`): "demoted to disk at step S from pool block B (tier slot N)", "promoted from disk at step T into
    pool block B for R (tier slot N)", "evicted from disk at step U (lru)", "dropped by the tier at step U
    (full): not stored".

    Raises:
        ValueError: more than MAX_KEYS keys.
    """
    wanted = list(dict.fromkeys(key.lower() for key in keys))
    if len(wanted) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys per query, got {len(wanted)}")
    columns = [TIER_MOVES.c[name] for name in MOVE_COLUMNS[:-1]]
    statement = (
        select(*columns)
        .where(TIER_MOVES.c.key_hex.in_(wanted), TIER_MOVES.c.run_id == run_id)
        .order_by(TIER_MOVES.c.id.desc())
        .limit(max(0, min(limit, MAX_MOVES)))
    )
    with connect(db) as connection:
        moves = frame(connection, statement, MOVE_COLUMNS[:-1]) if wanted else pd.DataFrame(columns=MOVE_COLUMNS[:-1])
    moves = moves.iloc[::-1].reset_index(drop=True)
    moves["move"] = [describe(row) for row in moves.itertuples(index=False)]
    return moves


def describe(move: Any) -> str:
    """One tier move in words (a row with MOVE_COLUMNS' fields)."""
    kind, step = move.kind, move.step
    if kind == DEMOTE:
        return f"demoted to disk at step {step} from pool block {_int(move.block_id)} (tier slot {_int(move.slot)})"
    if kind == PROMOTE:
        return (f"promoted from disk at step {step} into pool block {_int(move.block_id)} for {move.request_id} "
                f"(tier slot {_int(move.slot)})")  # fmt: skip
    if kind == TIER_EVICT:
        return f"evicted from disk at step {step} ({move.reason})"
    return f"dropped by the tier at step {step} ({move.reason}): not stored"


def _int(value: object) -> object:
    """A column value that pandas may hold as a float (a NULL beside integers) shown as an integer."""
    return int(value) if isinstance(value, float) and value == value else value


class Promotion(NamedTuple):
    """One block a request read from the disk tier."""

    block: int  # the request's pool block it was read into
    key_hex: str
    slot: int  # the tier slot it came from
    step: int
    at: float  # epoch seconds


def request_promotions(db: Readable, run_id: str, request_id: str, limit: int = MAX_PROMOTIONS) -> list[Promotion]:
    """The blocks `request_id` read from the disk tier, in table order (from its PROMOTE events)."""
    statement = (
        select(EVENTS.c.step, EVENTS.c.time, EVENTS.c.detail)
        .where(EVENTS.c.request_id == request_id, EVENTS.c.run_id == run_id, EVENTS.c.kind == PROMOTE)
        .order_by(EVENTS.c.id)
        .limit(limit)
    )
    with connect(db) as connection:
        rows = connection.execute(statement).all()
    found: list[Promotion] = []
    for step, at, detail in rows:
        for block, key, slot in zip(detail.get("block_ids") or (), detail.get("keys") or (), detail.get("slots") or ()):
            found.append(Promotion(int(block), str(key).lower(), int(slot), int(step), float(at)))
    return found


class TierFate(NamedTuple):
    """What the disk tier did with a block after the pool evicted it (`tier_fate`)."""

    demoted_at: float | None  # when its store was planned (None: it was never stored, e.g. dropped at once)
    demoted_step: int | None
    slot: int | None
    gone_kind: str | None  # TIER_EVICT or TIER_DROP when the tier lost it before the lookup; None: still held
    gone_at: float | None
    gone_step: int | None
    gone_reason: str | None  # TierReason value

    @property
    def lost(self) -> bool:
        """Whether the block was in neither tier at the lookup: evicted from (or dropped by) the tier too."""
        return self.gone_kind is not None


def tier_fate(db: Readable, run_id: str, key_hex: str, after: float, before: float) -> TierFate | None:
    """What the disk tier did with `key_hex` around a pool eviction (at `after`) up to a lookup (`before`),
    from the key's newest MAX_FATE_MOVES moves in the run: lost (evicted from the tier, or dropped by it,
    after the pool eviction), still held (demoted, not lost since), or None when the tier neither held nor
    lost it then (no tier, or an eviction it is never offered: reset, window).

    The demotion may precede the pool eviction: a block the tier already held (an engine stopping writes
    its cached blocks back) is not stored again when the pool evicts it.
    """
    statement = (
        select(TIER_MOVES.c.kind, TIER_MOVES.c.time, TIER_MOVES.c.step, TIER_MOVES.c.slot, TIER_MOVES.c.reason)
        .where(TIER_MOVES.c.key_hex == key_hex.lower(), TIER_MOVES.c.run_id == run_id, TIER_MOVES.c.time <= before)
        .order_by(TIER_MOVES.c.id.desc())
        .limit(MAX_FATE_MOVES)
    )
    with connect(db) as connection:
        moves = connection.execute(statement).all()
    demoted: tuple[float | None, int | None, int | None] = (None, None, None)
    held, gone = False, None
    for kind, at, step, slot, reason in reversed(moves):
        if kind == DEMOTE:
            demoted, held, gone = (at, step, slot), True, None
        elif kind in (TIER_EVICT, TIER_DROP):
            if kind == TIER_DROP and reason != "writer":
                demoted = (None, None, None)  # dropped before any store: the tier never held this copy
            held, gone = False, (kind, at, step, reason)
    if gone is not None and gone[1] >= after:
        return TierFate(*demoted, *gone)
    if held:
        return TierFate(*demoted, None, None, None, None)
    return None
