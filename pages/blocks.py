"""Blocks: every physical KV block, live; each block's life from the history; a request's blocks over time;
block tables side by side; and the guided scenario "Sharing and copy-on-write"."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import charts, timeline_charts
from app.frames import align_tables, block_category, block_counts
from app.hosting import get_host
from app.prompting import decode, token_pieces
from app.scenario import ScenarioError, ScenarioRun, SharingScenario
from app.tiers import TIER_OFF, disk_blocks_frame, occupancy_text
from app.ui import REFRESH_S, SLOW_REFRESH_S, age, fmt_clock, fmt_time, kept, read_history, wait_for_history
from engine.core.snapshot import newest_first
from engine.core.tier_view import PromotedBlock
from storage.read import queries

LARGE_POOL = 4096  # pools above this refresh less often
MAX_STACKED = 16  # blocks one stacked timeline draws
NO_HIGHLIGHT = "(none)"
SCENARIO_PAUSE_S = 0.8  # between the scenario's actions, so the timeline is seen filling in

host = get_host()
console = host.console
engine = console.engine
tokenizer = console.tokenizer
block_size = console.config.block_size
num_blocks = engine.num_blocks  # per KV group pool
groups = [g.name for g in engine.stats().groups] or ["full"]
state = st.session_state

if not 0 <= state.get("blocks_inspect_id", 0) < num_blocks:  # a restart may have shrunk the pool
    state["blocks_inspect_id"] = 0


def on_grid_select() -> None:
    """A click on the grid selects that block for the inspector (the cell position gives its id)."""
    points = state["blocks_grid"].selection.points
    if not points or "x" not in points[0] or "y" not in points[0]:
        return
    block_id = charts.block_at(points[0]["x"], points[0]["y"], charts.grid_columns(num_blocks))
    if 0 <= block_id < num_blocks:
        state["blocks_inspect_id"] = block_id


def history_table(frame: pd.DataFrame) -> None:
    """A block history's rows, every word of them (no cut-off detail column); a `block` column when the
    frame holds several blocks' rows."""
    table = pd.DataFrame(
        {
            **({"block": frame["block"]} if "block" in frame else {}),
            "step": frame["step"],
            "time (UTC)": [fmt_clock(t) for t in frame["time"]],
            "event": frame["event"],
            "request": frame["request_id"].fillna("—"),
            "what happened": [c + (f" — {m}" if m else "") for c, m in zip(frame["change"], frame["marker"])],
            "ref count": frame["ref_count"],
            "holders after": [", ".join(h) or "none" for h in frame["holders"]],
        }
    )
    st.dataframe(
        table,
        hide_index=True,
        column_config={
            "what happened": st.column_config.TextColumn(width="large"),
            "holders after": st.column_config.TextColumn(width="medium"),
        },
        height=min(420, 38 + 35 * len(table)),
    )


def stacked(timelines: dict[int, queries.BlockTimeline], key: str, titles: dict[int, str] | None = None) -> None:
    """The timelines of several blocks on one step axis (`key`: the chart's, unique on the page): blocks
    whose lives differ first, each set of identical lives drawn once with its count."""
    titles = titles or {}
    lives = life_groups({b: t for b, t in timelines.items() if not t.rows.empty}, set(titles))
    if not lives:
        st.caption("No stored events for these blocks yet (the history writer commits about every second).")
        return
    drawn = lives[:MAX_STACKED]
    if len(lives) > MAX_STACKED:
        st.caption(f"{len(lives)} different lives; the first {MAX_STACKED} are drawn.")
    shown = [(ids[0], timelines[ids[0]]) for ids in drawn]
    figure = timeline_charts.block_timelines([(life_title(ids, titles), timelines[ids[0]].rows) for ids in drawn])
    st.plotly_chart(figure, key=key, width="stretch")
    with st.expander("Every change of these blocks, with the holders after it"):
        rows = pd.concat([timelines[b].rows.assign(block=b) for ids in drawn for b in ids]).sort_values(["event_id", "block"], kind="stable")
        history_table(rows)
    if any(not t.complete for _, t in shown):
        st.caption("Part of this history was pruned: each block is drawn from its first stored allocation.")


def life_groups(timelines: dict[int, queries.BlockTimeline], titled: set[int]) -> list[list[int]]:
    """Block ids grouped by identical lives (the same events at the same steps with the same counts),
    lives that differ from every other first (a copy-on-write tail and its copies), then the largest sets.
    A block in `titled` (one the page names, as the scenario's) stays alone."""
    groups: dict[tuple, list[int]] = {}
    for block_id, timeline in timelines.items():
        rows = timeline.rows
        life = tuple(zip(rows["step"].astype(int), rows["event"], rows["ref_count"].astype(int)))
        if block_id in titled:
            life = (block_id, life)
        groups.setdefault(life, []).append(block_id)
    return sorted(groups.values(), key=lambda ids: (len(ids) > 1, -len(ids), ids[0]))


def life_title(block_ids: list[int], titles: dict[int, str]) -> str:
    """A row's title: the block's own, or "block 0, 1, 2 … (14 blocks, one life)"."""
    if len(block_ids) == 1:
        return titles.get(block_ids[0], f"block {block_ids[0]}")
    listed = ", ".join(map(str, block_ids[:3])) + (" …" if len(block_ids) > 3 else "")
    return f"block {listed} ({len(block_ids)} blocks, one life)"


# ---------------------------------------------------------------- page
st.title("Blocks")
st.caption(
    f"{num_blocks:,} physical blocks of {block_size} token slots per KV group; block id = row × "
    f"{charts.grid_columns(num_blocks)} + column. Click a cell (or type an id) to inspect it and see its life."
)

# ---------------------------------------------------------------- guided scenario
with st.container(border=True):
    st.markdown("#### Guided scenario: sharing and copy-on-write")
    st.markdown(
        "Two requests share one full block and one half-full block, then append different tokens: what "
        "happens to the reference counts, when is a block copied, and when can the old block safely be "
        "reused? One click plays it on this engine — a parent of one full and one half-full block, two "
        "forks appending different tokens, the parent's release — with new request ids and a cache "
        "namespace of its own, so nobody else's requests or cached blocks are touched, and releases all "
        "it made at the end."
    )
    scenario_slot = st.empty()

    def show_scenario(run: ScenarioRun) -> None:
        """Redraw the scenario's timeline and sentences (after each of its actions, and on later reruns)."""
        with scenario_slot.container():
            timelines = read_history(
                queries.block_timelines, host.db, console.run_id, run.blocks, groups[0], run.request_ids
            ) or {}
            titles = {}
            if run.full_block is not None:
                titles[run.full_block] = f"block {run.full_block}: the full block, shared"
            if run.tail_block is not None:
                titles[run.tail_block] = f"block {run.tail_block}: the parent's half-full tail"
            for child, copy in zip(run.children, run.copies):
                titles[copy] = f"block {copy}: {child}'s copy of the tail"
            stacked(timelines, f"blocks_scenario_chart_{len(run.steps)}", titles)
            for number, step in enumerate(run.steps, start=1):
                st.markdown(f"**{number}.** {step.text}")

    c = st.columns([1, 3])
    if c[0].button("Run the scenario", type="primary", key="blocks_scenario_go"):
        scenario = SharingScenario(engine, lambda: host.writer.flush(timeout_s=30), wait_s=SCENARIO_PAUSE_S)
        try:
            with st.spinner("Playing the scenario on the shared engine…"):
                state["blocks_scenario"] = scenario.run(on_action=show_scenario)
        except ScenarioError as exc:
            st.error(f"The scenario stopped: {exc}. Everything it created was released.")
    elif state.get("blocks_scenario") is not None:
        run = state["blocks_scenario"]
        if any(v.request_id == run.parent for v in engine.requests()):
            show_scenario(run)
        else:
            state["blocks_scenario"] = None  # the engine was restarted: its blocks are another run's
    c[1].caption(
        "The timeline is read back from the history database, like every block's below: the same "
        "events, so it is also there after a restart (`python -m cli block-history`)."
    )

# ---------------------------------------------------------------- the pool
if state.get("blocks_group") not in groups:
    state["blocks_group"] = groups[0]
c = st.columns([1, 2, 3])
live = c[0].toggle("Live", **kept("blocks_live", True))
group = c[1].radio(
    "KV group", groups, horizontal=True, **kept("blocks_group", groups[0]),
    help="Full-attention layers and sliding-window layers keep separate pools and tables",
) if len(groups) > 1 else groups[0]
request_ids = [r.request_id for r in newest_first(engine.requests())]
if state.get("blocks_highlight") not in [NO_HIGHLIGHT, *request_ids]:
    state["blocks_highlight"] = NO_HIGHLIGHT
highlight = c[2].selectbox(
    "Highlight a request's blocks", [NO_HIGHLIGHT, *request_ids], **kept("blocks_highlight", NO_HIGHLIGHT),
    help="Outlines in blue the blocks its table holds",
)
interval = (REFRESH_S * 2 if num_blocks <= LARGE_POOL else REFRESH_S * 5) if live else None
wait_for_history(host)  # what this operator just did (a finished request, a reset) is in before the page reads
run_ids = read_history(lambda db: queries.runs(db, limit=50)["id"].tolist(), host.db) or []
if console.run_id not in run_ids:
    run_ids.insert(0, console.run_id)
if state.get("blocks_run") not in run_ids:
    state["blocks_run"] = console.run_id
c = st.columns([2, 3])
run_id = c[0].selectbox(
    "History of run", run_ids, **kept("blocks_run", console.run_id),
    format_func=lambda rid: f"{rid} (this engine)" if rid == console.run_id else rid,
    help="Whose block lives to draw: earlier runs' histories stay in the database and read the same",
)
c[1].caption(
    "A block's life: every change of its reference count, from the persisted events — allocated, shared "
    "by a fork or a prefix hit, copied on write, released, cached, evicted. Where the count reaches 0 it "
    "says so: *no holder left: safe to reuse*, or, for a block in the prefix index, *evictable from here on*."
)


@st.cache_data(ttl=SLOW_REFRESH_S, max_entries=256, show_spinner=False)
def stored_life(_db, run: str, block_id: int, kv_group: str) -> queries.BlockTimeline:
    """One block's timeline, read at most once per SLOW_REFRESH_S (the live grid redraws more often)."""
    return queries.block_timelines(_db, run, [block_id], kv_group)[block_id]


@st.fragment(run_every=interval)
def pool_view() -> None:
    snapshot = engine.snapshot()
    blocks = sorted((b for b in snapshot.blocks if b.group == group), key=lambda b: b.block_id)
    statuses = {r.request_id: r.status for r in snapshot.requests}
    marked: tuple[int, ...] = ()
    if highlight != NO_HIGHLIGHT:
        view = next((r for r in snapshot.requests if r.request_id == highlight), None)
        if view is not None:
            marked = view.block_tables.get(group, ())
            held = "holds" if view.holds_blocks else f"is {view.status} and holds nothing; it ended with"
            st.caption(f"**{highlight}** {held} blocks {', '.join(map(str, marked)) or '—'} (outlined in blue).")
    tier = snapshot.tier
    promoted = {p.block_id: p for p in tier.promoted} if tier is not None and tier.group == group else {}
    legend = charts.legend_markdown(block_counts(blocks))
    if promoted:
        legend += f' &nbsp; <span style="color:{charts.PROMOTED_COLOUR}">◥</span> **{charts.PROMOTED_NAME}**: {len(promoted):,}'
    st.markdown(legend, unsafe_allow_html=True)
    grid = charts.block_grid(blocks, block_size, selected=state.get("blocks_inspect_id"), highlight=marked,
                             statuses=statuses, promoted=sorted(promoted))  # fmt: skip
    st.plotly_chart(
        grid,
        key="blocks_grid",
        on_select=on_grid_select,
        selection_mode="points",
        width="content",
        config={"displayModeBar": False, "scrollZoom": False},
    )
    disk_tier(snapshot)
    block_id = st.number_input("Block id", 0, num_blocks - 1, step=1, width=240, **kept("blocks_inspect_id", 0))
    inspect(blocks[int(block_id)], snapshot.time, statuses, promoted.get(int(block_id)))
    block_life(int(block_id))  # in this fragment, so a new selection redraws its life at once


def disk_tier(snapshot) -> None:
    """The second KV tier beside the pool: its occupancy, the pool blocks it filled, and the blocks it holds."""
    with st.container(border=True, key="blocks_disk_tier"):
        st.markdown("#### Disk tier")
        stats, view = snapshot.stats.tier, snapshot.tier
        if stats is None or view is None:
            st.info(TIER_OFF)
            return
        c = st.columns(4)
        c[0].metric("Ready blocks", f"{stats.ready_blocks:,}", help="On disk, checksummed: found by lookups past the pool's hit")
        c[1].metric("Being written", f"{stats.writing_blocks:,}", help="Stores the writer thread has not confirmed yet: never served")
        c[2].metric("Slots", f"{stats.num_slots:,}", help="Blocks the tier's files hold; a full tier gives up its least recently used block")
        c[3].metric("Promoted blocks", f"{stats.loads:,}", help="Blocks read from disk into the pool instead of computed")
        st.caption(occupancy_text(stats) + f" · {stats.drops:,} dropped · {stats.corrupt:,} corrupt loads")
        if view.promoted:
            ids = ", ".join(str(p.block_id) for p in view.promoted)
            st.markdown(f"Pool blocks promoted from disk in their current life ({view.group} group): **{ids}** "
                        f"(marked ◥ on the grid)")  # fmt: skip
        else:
            st.caption("No pool block holds K/V promoted from disk now.")
        if not view.blocks:
            st.caption("The tier holds no block yet: blocks arrive when the pool evicts a cached full block.")
            return
        shown = len(view.blocks)
        st.caption(f"The {shown:,} most recently used of its {stats.ready_blocks:,} ready blocks; rank 1 is the last it gives up.")
        st.dataframe(disk_blocks_frame(view, tokenizer), hide_index=True, height=min(320, 38 + 35 * shown))


def inspect(block, now: float, statuses: dict[str, str], promotion: PromotedBlock | None = None) -> None:
    """The selected block's numbers and tokens; `promotion` (a `PromotedBlock`) when the disk tier filled it."""
    st.markdown(f"#### Block {block.block_id} — {block_category(block)}")
    c = st.columns(4)
    c[0].metric("Reference count", block.ref_count)
    c[1].metric("Tokens", f"{block.num_tokens}/{block_size}")
    c[2].metric("Prefix hits", block.hit_count, help="Index lookups that reused it since it was handed out; forks are not hits")
    c[3].metric("Age", age(block.created_at, now) if block.created_at else "—", help="Since it was last handed out")
    if block.state == "free":
        st.markdown("Free: no holder and no key. It holds nothing; its slots are rewritten before anyone reads them.")
        return
    holders = ", ".join(f"`{h}` ({statuses.get(h, 'gone')})" for h in block.holders) or "none"
    st.markdown(
        f"positions **{block.start_pos}–{block.start_pos + max(block.num_tokens, 1) - 1}** · "
        f"last used {fmt_time(block.last_used) if block.last_used else '—'}  \n"
        f"holders: {holders}  \nkey `{block.key or '— (not in the prefix index)'}`  \n"
        f"parent key `{block.parent_key or '—'}`"
    )
    if promotion is not None:
        st.markdown(
            f"**Promoted from the disk tier** at step {promotion.step} (tier slot {promotion.slot}, key "
            f"`{promotion.key}…`): its K/V were read from disk, not computed, when it was handed out."
        )
    if block.num_tokens:
        with st.expander("Decoded tokens"):
            st.code(decode(tokenizer, block.token_ids), language=None, wrap_lines=True)
            st.dataframe(
                pd.DataFrame(
                    {
                        "position": range(block.start_pos, block.start_pos + block.num_tokens),
                        "token id": block.token_ids,
                        "text": token_pieces(tokenizer, block.token_ids),
                    }
                ),
                hide_index=True,
            )


def block_life(block_id: int) -> None:
    """The selected block's life in the chosen run: the step chart, then every row of it."""
    st.markdown(f"##### Block {block_id}'s life" + ("" if run_id == console.run_id else f" in run {run_id}"))
    timeline = read_history(stored_life, host.db, run_id, block_id, group)
    if timeline is None:
        return
    if timeline.rows.empty:
        st.caption(f"Block {block_id} has no stored events in this run yet.")
        return
    st.plotly_chart(timeline_charts.block_timelines([(f"block {block_id}", timeline.rows)]), key="blocks_life_chart", width="stretch")
    history_table(timeline.rows)
    if (timeline.rows["event"] == "cow").any():
        st.caption(
            "Why copy-on-write? A block that several tables share holds the same tokens for all of them, so "
            "a holder that writes into it gets a private copy first. Even when the other holder is a "
            "finished parent that will never write again, it still holds the block and may be forked "
            "again; only one holder may ever append in place."
        )
    if not timeline.complete:
        st.caption("Older events of this run were pruned: the block is drawn from its first stored allocation.")


pool_view()

# ---------------------------------------------------------------- a request's blocks over time
st.subheader("A request's blocks over time")
recorded = read_history(queries.recent_requests, host.db, run_id, 500)
options = [] if recorded is None else recorded["request_id"].tolist()
if state.get("blocks_family_pick") not in options:
    state["blocks_family_pick"] = options[0] if options else None
c = st.columns([2, 1])
picked_request = c[0].selectbox(
    "Request", options, **kept("blocks_family_pick", options[0] if options else None),
    placeholder="no request recorded in this run yet",
)
whole_family = c[1].toggle("Its whole fork family", **kept("blocks_family_whole", True),
                           help="The request's oldest recorded ancestor and every descendant")  # fmt: skip
if picked_request is not None:
    members = read_history(queries.fork_family, host.db, run_id, picked_request) if whole_family else [picked_request]
    if members:
        blocks_of = read_history(queries.request_blocks, host.db, run_id, members, group) or []
        st.caption(
            f"{len(members)} request(s): {', '.join(members[:12])}{' …' if len(members) > 12 else ''} · "
            f"{len(blocks_of)} block(s); blocks whose lives differ come first (a shared tail and its copies), "
            "identical lives are drawn once with their count"
        )
        timelines = read_history(queries.block_timelines, host.db, run_id, blocks_of, group, members) or {}
        stacked(timelines, "blocks_family_chart")

# ---------------------------------------------------------------- block tables side by side
st.subheader("Block tables side by side")
st.caption(
    "Each row is a request's block table by logical block index, parents above their children; equal ids "
    "in a column are one shared physical block. Where a child's row turns to another id, copy-on-write "
    "gave it its own block. Requests that no longer hold blocks keep the table they ended with, in grey."
)
views = newest_first(engine.requests())
with_tables = [r.request_id for r in views if r.block_tables.get(group)]
if "blocks_tables" not in state:
    state["blocks_tables"] = [r.request_id for r in views if r.holds_blocks][:4]
state["blocks_tables"] = [rid for rid in state["blocks_tables"] if rid in with_tables]
picked = st.multiselect("Requests", with_tables, **kept("blocks_tables", []), placeholder="Pick requests to compare")
if picked:
    by_id = {r.request_id: r for r in engine.requests()}
    rows = [by_id[rid] for rid in picked if rid in by_id]
    alignment = align_tables(rows, group)
    by_id_rows = {r.request_id: r for r in rows}
    st.plotly_chart(charts.table_alignment(alignment), key="blocks_alignment")
    summary = pd.DataFrame(
        {
            "request": alignment.request_ids,
            "status": [by_id_rows[rid].status for rid in alignment.request_ids],
            "holds its blocks": ["yes" if held else "no" for held in alignment.holding],
            "blocks": [len(by_id_rows[rid].block_tables.get(group, ())) for rid in alignment.request_ids],
            "parent": [by_id[rid].parent_id or "—" for rid in alignment.request_ids],  # selected or not
            "shared with its parent": [
                "—" if alignment.compared_with[rid] is None else str(
                    sum(1 for a, b in zip(row, alignment.block_ids[alignment.request_ids.index(alignment.compared_with[rid])]) if a is not None and a == b)
                )
                for rid, row in zip(alignment.request_ids, alignment.block_ids)
            ],
            "diverges from its parent at block": [
                "—" if alignment.divergence[rid] is None else str(alignment.divergence[rid]) for rid in alignment.request_ids
            ],
            "cow copies": [by_id_rows[rid].cow_copies for rid in alignment.request_ids],
        }
    )
    st.table(summary)
else:
    st.caption("No request selected (finished requests keep the table they ended with).")
