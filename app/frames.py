"""Engine snapshots as DataFrames and headline numbers: plain functions, no Streamlit, no plotting.

Everything here reads immutable values (`EngineSnapshot`, `BlockView`, `RequestView`, `PoolStats`), so
pages can call it on any thread and tests can call it without a server.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd

from engine.core.snapshot import BlockView, PoolStats, RequestView

FREE = "free"
CACHED = "cached (evictable)"
MAX_REF_CATEGORY = 4  # reference counts of this or more share one colour


def block_category(block: BlockView) -> str:
    """The colour class of a block: free, cached-evictable, or referenced ×k (k capped)."""
    if block.state == "referenced":
        k = block.ref_count
        return f"referenced ×{k}" if k < MAX_REF_CATEGORY else f"referenced ×{MAX_REF_CATEGORY}+"
    return CACHED if block.state == "evictable" else FREE


def category_order() -> list[str]:
    return [FREE, CACHED, *(f"referenced ×{k}" for k in range(1, MAX_REF_CATEGORY)), f"referenced ×{MAX_REF_CATEGORY}+"]


def block_counts(blocks: Sequence[BlockView]) -> pd.DataFrame:
    """How many blocks are in each colour class (every class listed, zeros included)."""
    counts = {name: 0 for name in category_order()}
    for block in blocks:
        counts[block_category(block)] += 1
    return pd.DataFrame({"state": list(counts), "blocks": list(counts.values())})


def requests_frame(requests: Sequence[RequestView]) -> pd.DataFrame:
    """One row per request, newest first, with its reuse numbers."""
    rows = [
        {
            "request": r.request_id,
            "parent": r.parent_id or "",
            "status": r.status,
            "retain": r.retain,
            "prompt tokens": r.num_prompt_tokens,
            "output tokens": len(r.output_token_ids),
            "hit position": r.cached_tokens,
            "computed tokens": r.computed_tokens,
            "hit source": r.hit_source,
            "cow copies": r.cow_copies,
            "preemptions": r.preemptions,
            "TTFT ms": None if r.ttft_s is None else round(r.ttft_s * 1000, 1),
            "finish": r.finish_reason or "",
            "blocks": sum(len(t) for t in r.block_tables.values()),
            "arrival": r.arrival_time,
        }
        for r in requests
    ]
    frame = pd.DataFrame(rows, columns=REQUEST_COLUMNS)
    return frame.sort_values("arrival", ascending=False, kind="stable").drop(columns="arrival").reset_index(drop=True)


REQUEST_COLUMNS = [
    "request", "parent", "status", "retain", "prompt tokens", "output tokens", "hit position",
    "computed tokens", "hit source", "cow copies", "preemptions", "TTFT ms", "finish", "blocks", "arrival",
]  # fmt: skip


def prefill_seconds_per_token(requests: Sequence[RequestView]) -> float | None:
    """Measured prefill cost: time from first schedule to first token over the tokens computed.

    Only requests never preempted and with computed prefill tokens count; None until one finished its
    prefill. An estimate (batched steps share time), good enough to price reuse.
    """
    seconds = 0.0
    tokens = 0
    for r in requests:
        if r.first_token_time is None or r.first_scheduled_time is None or r.preemptions or r.computed_tokens <= 0:
            continue
        seconds += r.first_token_time - r.first_scheduled_time
        tokens += r.computed_tokens
    return seconds / tokens if tokens else None


@dataclass(frozen=True)
class Headline:
    """The Overview's numbers at one moment."""

    stats: PoolStats
    tokens_saved: int  # prompt tokens not computed: prefix hits (replays excluded) and fork sharing
    seconds_per_token: float | None  # measured prefill cost
    evictions_per_min: float | None  # capacity evictions, over the last minute of samples (None without history)
    window_drops_per_min: float | None  # sliding-window drops (not capacity evictions), the same way

    @property
    def prefill_seconds_saved(self) -> float | None:
        return None if self.seconds_per_token is None else self.tokens_saved * self.seconds_per_token


def headline(
    stats: PoolStats, requests: Sequence[RequestView], samples: Sequence[tuple[float, PoolStats]], now: float
) -> Headline:
    return Headline(
        stats=stats,
        tokens_saved=stats.tokens_saved,
        seconds_per_token=prefill_seconds_per_token(requests),
        evictions_per_min=evictions_per_minute(samples, stats, now),
        window_drops_per_min=evictions_per_minute(samples, stats, now, count=window_drops),
    )


def capacity_evictions(stats: PoolStats) -> int:
    """Keys dropped for any reason but a sliding window's (LRU victims, resets, their chained children)."""
    return stats.evictions - stats.window_evictions


def window_drops(stats: PoolStats) -> int:
    """Keys dropped because their state left a sliding window: the window's rule, not a full pool."""
    return stats.window_evictions


def evictions_per_minute(
    samples: Sequence[tuple[float, PoolStats]],
    current: PoolStats,
    now: float,
    window_s: float = 60.0,
    count: Callable[[PoolStats], int] = capacity_evictions,
) -> float | None:
    """`count` (capacity evictions unless told) per minute since the newest sample at least `window_s` old
    (else the oldest sample)."""
    if not samples:
        return None
    base_time, base = samples[0]
    for t, s in samples:
        if t > now - window_s:
            break
        base_time, base = t, s
    span = now - base_time
    if span <= 0:
        return None
    return (count(current) - count(base)) * 60.0 / span


def history_frame(samples: Sequence[tuple[float, PoolStats]]) -> pd.DataFrame:
    """The ring of PoolStats samples as one row per sample (time as a timestamp)."""
    rows = [
        {
            "time": t,
            "KV usage": s.kv_usage,
            "prefix hit rate": s.prefix_hit_rate,
            "fork sharing": s.fork_share_rate,
            "sharing ratio": s.sharing_ratio,
            "free": s.free_blocks,
            "cached (evictable)": s.evictable_blocks,
            "referenced": s.used_blocks,
            "evictions": capacity_evictions(s),
            "window drops": window_drops(s),
            "cow copies": s.cow_copies,
            "preemptions": s.preemptions,
            "running": s.num_running,
            "waiting": s.num_waiting,
        }
        for t, s in samples
    ]
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
    return frame


@dataclass(frozen=True)
class TableAlignment:
    """Block tables of several requests laid out by logical block index, each compared with its parent.

    A request that no longer holds blocks (finished without retain, or released) keeps the table it
    ended with as a row, marked as not holding: its cells share nothing with anyone.
    """

    request_ids: list[str]
    block_ids: list[list[int | None]]  # [row][logical index]; None past the end of a shorter table
    holding: list[bool]  # whether the row's request still holds its table
    shared: list[list[int]]  # holding rows with the same block at that index (0 in a row that holds nothing)
    compared_with: dict[str, str | None]  # each row's parent when it is among the rows, else None
    divergence: dict[str, int | None]  # first logical index where a row's block differs from its parent's


def align_tables(requests: Sequence[RequestView], group: str = "full") -> TableAlignment:
    """Rows side by side, parents before their children: equal ids in a column are shared blocks; where a
    child's row turns to another id, copy-on-write gave it its own block.

    Args:
        requests: the rows (reordered by `family_order`: a parent before its children).
        group: which KV group's tables ("full" or "sliding"); a request without one has an empty row.
    """
    rows = family_order(requests)
    tables = [r.block_tables.get(group, ()) for r in rows]
    width = max((len(t) for t in tables), default=0)
    ids = [[*t, *([None] * (width - len(t)))] for t in tables]
    holding = [r.holds_blocks for r in rows]
    shared = [
        [
            0 if not held or cell is None else sum(1 for other, h in zip(ids, holding) if h and other[i] == cell)
            for i, cell in enumerate(row)
        ]
        for row, held in zip(ids, holding)
    ]
    by_id = {r.request_id: row for r, row in zip(rows, ids)}
    compared_with: dict[str, str | None] = {}
    divergence: dict[str, int | None] = {}
    for r, row in zip(rows, ids):
        parent = r.parent_id if r.parent_id in by_id else None
        compared_with[r.request_id] = parent
        base = by_id.get(parent) if parent is not None else None
        diff = [] if base is None else [i for i, (a, b) in enumerate(zip(base, row)) if a != b and None not in (a, b)]
        divergence[r.request_id] = diff[0] if diff else None
    return TableAlignment([r.request_id for r in rows], ids, holding, shared, compared_with, divergence)


def family_order(requests: Sequence[RequestView]) -> list[RequestView]:
    """`requests` with every parent before its children (depth first), siblings and families by arrival."""
    by_id = {r.request_id: r for r in requests}
    children: dict[str, list[RequestView]] = {}
    roots = []
    for r in sorted(requests, key=lambda r: r.arrival_time):
        if r.parent_id in by_id:
            children.setdefault(r.parent_id, []).append(r)
        else:
            roots.append(r)
    ordered: list[RequestView] = []
    stack = roots[::-1]
    while stack:
        r = stack.pop()
        ordered.append(r)
        stack.extend(children.get(r.request_id, [])[::-1])
    return ordered


def holders_text(holders: Sequence[str], statuses: dict[str, str], limit: int = 8) -> str:
    """Holders by name with their status ("req-0 (retained), req-1 (running)"), at most `limit` named."""
    named = [f"{h} ({statuses[h]})" if h in statuses else h for h in holders[:limit]]
    more = len(holders) - limit
    return ", ".join(named) + (f" and {more} more" if more > 0 else "") if holders else "none"


@dataclass(frozen=True)
class PrefixNode:
    key: str
    parent: str  # parent node key, or a namespace root id
    block: BlockView


def prefix_tree(blocks: Sequence[BlockView], limit: int) -> tuple[list[PrefixNode], list[str], int]:
    """The prefix index as a forest, parents before children, at most `limit` nodes.

    Returns:
        (nodes, roots, dropped): the kept nodes in breadth-first order, the namespace roots they hang
        from (parent keys that are not block keys), and how many nodes were left out.
    """
    keyed = {b.key: b for b in blocks if b.key is not None}
    children: dict[str, list[BlockView]] = {}
    for block in keyed.values():
        children.setdefault(block.parent_key or "", []).append(block)
    roots = sorted(k for k in children if k not in keyed)
    order: list[PrefixNode] = []
    frontier = [(root, b) for root in roots for b in sorted(children[root], key=lambda b: -b.hit_count)]
    while frontier and len(order) < limit:
        following = []
        for parent, block in frontier:
            if len(order) >= limit:
                break
            order.append(PrefixNode(block.key or "", parent, block))
            following += [(block.key, c) for c in sorted(children.get(block.key or "", []), key=lambda b: -b.hit_count)]
        frontier = following
    return order, roots, len(keyed) - len(order)


@dataclass(frozen=True)
class PrefixRun:
    """A chain of cached blocks drawn as one tile: each block but the last has exactly one child, the
    next one, and all share one hit count and one reference count (so the tile's colour is true)."""

    key: str  # the run's last block's key: the id children hang from
    parent: str  # the key of the run above (its last block), or a namespace root
    blocks: tuple[BlockView, ...]  # in chain order

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.blocks)


def prefix_runs(nodes: Sequence[PrefixNode]) -> list[PrefixRun]:
    """`prefix_tree`'s nodes with every single-child stretch of equal hits and holders merged into one run
    (a radix tree of blocks), parents before children. A long chain with no branch is one tile, not a
    staircase of one tile per block."""
    children: dict[str, list[PrefixNode]] = {}
    for node in nodes:
        children.setdefault(node.parent, []).append(node)
    keys = {node.key for node in nodes}
    runs: list[PrefixRun] = []
    starts = [node for node in nodes if node.parent not in keys]  # hang from a namespace root
    while starts:
        following = []
        for start in starts:
            chain, node = [start], start
            while len(kids := children.get(node.key, [])) == 1 and _same_colour(kids[0].block, node.block):
                node = kids[0]
                chain.append(node)
            runs.append(PrefixRun(node.key, start.parent, tuple(n.block for n in chain)))
            following += children.get(node.key, [])
        starts = following
    return runs


def _same_colour(a: BlockView, b: BlockView) -> bool:
    return (a.hit_count, a.ref_count) == (b.hit_count, b.ref_count)


@dataclass(frozen=True)
class TreeShape:
    """How the prefix tree's icicle is laid out: which tiles there are, and how tall it must be for its
    smallest drawn tile to hold one line of label.

    An icicle gives every level one column of equal width, so a namespace drawn as its own tile costs a
    column: it is drawn only when it is needed to hold the tree together (several tiles at the top, or
    several namespaces). Heights follow tokens, so the figure grows with the number of small branches.
    """

    namespaces: tuple[str, ...]  # namespace roots drawn as tiles of their own (none: the top run is the root)
    parent_of: dict[str, str]  # a run's key -> the id it hangs from in the figure ("" for the root)
    tokens_under: dict[str, int]  # a run's key or a namespace -> the tokens of it and everything below it
    depth: int  # levels of tiles in the whole tree
    height_px: int  # of the plot area
    tile_px: dict[str, float]  # a drawn tile's key -> its height in pixels at the top-level view


def tree_shape(
    runs: Sequence[PrefixRun], roots: Sequence[str], max_levels: int, min_tile_px: float, height_range: tuple[int, int]
) -> TreeShape:
    """The icicle layout of `prefix_runs` (parents before children) under the namespace `roots`.

    Args:
        max_levels: levels the figure draws at once (deeper ones show when a tile is clicked).
        min_tile_px: the height the smallest drawn tile should get.
        height_range: (least, most) plot height in pixels.
    """
    used = [r for r in roots if any(run.parent == r for run in runs)]
    top = [run for run in runs if run.parent in set(used)]
    namespaces = () if len(top) == 1 else tuple(used)
    parent_of = {run.key: ("" if run.parent in used and not namespaces else run.parent) for run in runs}
    level = {ns: 0 for ns in namespaces}
    for run in runs:  # parents come first
        level[run.key] = level.get(parent_of[run.key], -1) + 1
    tokens_under = {run.key: run.num_tokens for run in runs} | {ns: 0 for ns in namespaces}
    for run in reversed(runs):  # children before their parents
        if parent_of[run.key]:
            tokens_under[parent_of[run.key]] += tokens_under[run.key]
    total = max(1, sum(tokens_under[run.key] for run in top))
    drawn = [k for k, lv in level.items() if lv < max_levels]
    smallest = min((tokens_under[k] for k in drawn), default=total) or 1
    least, most = height_range
    height = int(min(most, max(least, min_tile_px * total / smallest)))
    return TreeShape(
        namespaces=namespaces,
        parent_of=parent_of,
        tokens_under=tokens_under,
        depth=max(level.values(), default=-1) + 1,
        height_px=height,
        tile_px={k: tokens_under[k] / total * height for k in drawn},
    )


def sibling_common_prefix(runs: Sequence[PrefixRun]) -> dict[str, int]:
    """Per run, how many leading tokens of its first block every sibling's first block also starts with
    (0 for an only child): siblings labelled from there differ at once, not after the same words."""
    by_parent: dict[str, list[PrefixRun]] = {}
    for run in runs:
        by_parent.setdefault(run.parent, []).append(run)
    shared: dict[str, int] = {}
    for siblings in by_parent.values():
        firsts = [run.blocks[0].token_ids for run in siblings]
        n = 0
        if len(siblings) > 1:
            while all(len(t) > n for t in firsts) and len({t[n] for t in firsts}) == 1:
                n += 1
        shared |= {run.key: n for run in siblings}
    return shared


def prefix_chain(blocks: Sequence[BlockView], key: str) -> list[BlockView]:
    """The cached blocks from a namespace root down to `key`, in order."""
    keyed = {b.key: b for b in blocks if b.key is not None}
    chain = []
    node = keyed.get(key)
    while node is not None:
        chain.append(node)
        node = keyed.get(node.parent_key)
    return chain[::-1]


def replay_sentence(view: RequestView, window: int, block_size: int, backtrack: int) -> str | None:
    """Why a request's hit on sliding-window layers saved what it saved, in one sentence, and what would
    have made its window state ready; None for a request with no hit.

    The state is ready at the hit position h when the cached sliding blocks cover [need, h), need being
    the block boundary at or before h - W + 1 (engine/core/kv_groups.py's window_ready_at).
    """
    h, s, e, r = view.cached_tokens, view.window_start, view.window_end, view.replay_from
    if h == 0 or view.replay_mode in ("none", "full"):
        return None
    need = max(0, h - window + 1) // block_size * block_size
    found = f"the window state found covered [{s}, {e}) ({e - s} tokens)"
    if view.replay_mode == "ready":
        return f"**{view.request_id}** · ready: {found}, all the {window}-token window at h = {h} needs: nothing replayed, {h} tokens saved."
    missing = []
    if s > need:
        missing.append(
            f"the older {s - need} tokens of state (a window backtrack of at least {backtrack + s - need} tokens, now "
            f"{backtrack}, in Settings keeps them)"
        )
    if e < h:
        missing.append(f"the state of [{e}, {h}) (dropped or never cached)")
    how = "exact" if view.replay_mode == "exact" else "approximate (without the state before r)"
    saved = "nothing" if r == 0 else f"{r} tokens"
    return (
        f"**{view.request_id}** · {how} replay: the hit reached h = {h}, but {found} where the {window}-token "
        f"window needs [{need}, {h}) ({h - need} tokens); it recomputed [{r}, {h}) and saved {saved}. Ready "
        f"state needed " + " and ".join(missing or [f"the blocks of [{need}, {h}) cached together"]) + "."
    )


def utc_csv(text: str, columns: Sequence[str] = ("time", "last_used")) -> str:
    """A CSV export with its epoch-second `columns` written as UTC times to the millisecond
    ("2026-03-01T09:14:05.123Z"), as the pages show them; an empty cell stays empty."""
    frame = pd.read_csv(io.StringIO(text))
    for column in columns:
        if column in frame:
            stamps = pd.to_datetime(frame[column], unit="s", utc=True)
            frame[column] = stamps.dt.strftime("%Y-%m-%dT%H:%M:%S.%f").str[:-3].where(stamps.notna()) + "Z"
    return frame.to_csv(index=False)
