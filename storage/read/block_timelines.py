"""Block lives read back: blocks' reference-count timelines replayed from a run's stored events
(storage.read.block_history does the replay; the full group's include the disk tier's demotions and
promotions), the blocks requests held, a request's fork family."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.engine import Dialect

from storage.read import block_history
from storage.read.access import Readable, connect
from storage.read.block_history import HISTORY_COLUMNS, StoredEvent
from storage.read.runs import latest_run_id
from storage.schema import EVENTS, REQUESTS

MAX_TIMELINE_BLOCKS = 256  # blocks one timeline query may ask about (a request's, a fork family's)
MAX_FAMILY = 256  # requests one fork family may list
FULL_GROUP = "full"  # the KV group the disk tier serves; its events carry no `group` (engine/core/events.py)


@dataclass(frozen=True)
class BlockTimeline:
    """One block's reference-count history in one run and KV group (storage/read/block_history.py)."""

    run_id: str
    group: str  # KV group: "full" or "sliding"
    block_id: int
    rows: pd.DataFrame  # HISTORY_COLUMNS, oldest first; `holders` holds tuples of request ids
    complete: bool  # False when the stored events start mid-life (pruned) or lack block lists



def block_timelines(
    db: Readable,
    run_id: str,
    block_ids: Sequence[int],
    group: str = "full",
    request_ids: Sequence[str] | None = None,
) -> dict[int, BlockTimeline]:
    """Every listed block's history, replayed from the run's stored events.

    Args:
        db: where to read.
        run_id: the run.
        block_ids: at most MAX_TIMELINE_BLOCKS physical blocks of `group`.
        group: the KV group.
        request_ids: when given, keep of each block's history only the stretch these requests took part
            in (`storage.read.block_history.rows_involving`).

    Returns:
        By block id, in the order asked for; a block without stored events has no rows.

    Raises:
        ValueError: too many blocks.
    """
    ids = list(dict.fromkeys(int(b) for b in block_ids))
    if len(ids) > MAX_TIMELINE_BLOCKS:
        raise ValueError(f"at most {MAX_TIMELINE_BLOCKS} blocks per timeline query, got {len(ids)}")
    if not ids:
        return {}
    with connect(db) as connection:
        touching = _touches_blocks(connection.dialect, ids)
        in_group = EVENTS.c.detail["group"].as_string() == group
        if group == FULL_GROUP:
            in_group = or_(in_group, EVENTS.c.kind.in_(block_history.TIER_KINDS))
        statement = (
            select(EVENTS.c.id, EVENTS.c.step, EVENTS.c.time, EVENTS.c.kind, EVENTS.c.request_id, EVENTS.c.block_id, EVENTS.c.detail)
            .where(
                EVENTS.c.run_id == run_id,
                EVENTS.c.kind.in_(block_history.BLOCK_KINDS),
                in_group,
                touching,
            )
            .order_by(EVENTS.c.id)
        )
        events = [StoredEvent(*row) for row in connection.execute(statement).all()]
    lives = block_history.replay(events, ids)
    timelines = {}
    for block_id, life in lives.items():
        changes = life.rows if request_ids is None else block_history.rows_involving(life, request_ids)
        rows = pd.DataFrame([change.values() for change in changes], columns=list(HISTORY_COLUMNS))
        timelines[block_id] = BlockTimeline(run_id, group, block_id, rows, life.complete)
    return timelines


def block_timeline(db: Readable, block_id: int, run_id: str | None = None, group: str = "full") -> BlockTimeline | None:
    """One block's history in `run_id` (default: the newest run); None when the history has no run."""
    run_id = run_id or latest_run_id(db)
    if run_id is None:
        return None
    return block_timelines(db, run_id, [block_id], group)[int(block_id)]


def _touches_blocks(dialect: Dialect, ids: list[int]) -> ColumnElement[bool]:
    """Events that name one of `ids`: as block_id (EVICT, a COW's copy, a call's first block), as a COW's
    source, or in the `block_ids` list of their detail (read with each backend's JSON set function)."""
    if dialect.name == "postgresql":
        elements = func.json_array_elements_text(EVENTS.c.detail["block_ids"]).table_valued("value")
        listed = select(elements.c.value).where(elements.c.value.in_([str(i) for i in ids])).exists()
    else:
        elements = func.json_each(EVENTS.c.detail, "$.block_ids").table_valued("value")
        listed = select(elements.c.value).where(elements.c.value.in_(ids)).exists()
    return or_(EVENTS.c.block_id.in_(ids), EVENTS.c.detail["src_block"].as_integer().in_(ids), listed)


def request_blocks(db: Readable, run_id: str, request_ids: Sequence[str], group: str = "full") -> list[int]:
    """The blocks these requests ever held in `group` (allocated, shared by a hit or a fork, copied), in
    the order they first took them."""
    kinds = (block_history.ALLOCATE, block_history.HIT, block_history.FORK, block_history.COW)
    statement = (
        select(EVENTS.c.kind, EVENTS.c.detail)
        .where(
            EVENTS.c.request_id.in_(list(request_ids)),
            EVENTS.c.run_id == run_id,
            EVENTS.c.kind.in_(kinds),
            EVENTS.c.detail["group"].as_string() == group,
        )
        .order_by(EVENTS.c.id)
    )
    with connect(db) as connection:
        found: dict[int, None] = {}
        for kind, detail in connection.execute(statement).all():
            ids = [detail.get("dst_block")] if kind == block_history.COW else detail.get("block_ids") or []
            found.update(dict.fromkeys(int(i) for i in ids if i is not None))
    return list(found)


def fork_family(db: Readable, run_id: str, request_id: str) -> list[str]:
    """`request_id`'s fork family in `run_id`: its oldest recorded ancestor, then every descendant,
    generation by generation, by arrival (at most MAX_FAMILY requests)."""
    with connect(db) as connection:
        root, seen = request_id, {request_id}
        while True:
            parent = connection.scalar(
                select(REQUESTS.c.parent_id).where(REQUESTS.c.run_id == run_id, REQUESTS.c.request_id == root)
            )
            if parent is None or parent in seen:
                break
            root = parent
            seen.add(root)
        family, generation = [root], [root]
        while generation and len(family) < MAX_FAMILY:
            statement = (
                select(REQUESTS.c.request_id)
                .where(REQUESTS.c.run_id == run_id, REQUESTS.c.parent_id.in_(generation))
                .order_by(REQUESTS.c.arrival_time, REQUESTS.c.request_id)
            )
            generation = [rid for rid in connection.scalars(statement).all() if rid not in family]
            family += generation
    return family[:MAX_FAMILY]
