"""Blocks: every physical KV block, live; click one to inspect it; compare block tables side by side."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import charts
from app.frames import HOLDING, align_tables, block_category, block_counts
from app.hosting import get_host
from app.prompting import decode, token_pieces
from app.ui import REFRESH_S, age, fmt_time, kept

LARGE_POOL = 4096  # pools above this refresh less often

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


st.title("Blocks")
st.caption(
    f"{num_blocks:,} physical blocks of {block_size} token slots per KV group; block id = row × "
    f"{charts.grid_columns(num_blocks)} + column. Click a cell (or type an id) to inspect it."
)
if state.get("blocks_group") not in groups:
    state["blocks_group"] = groups[0]
c = st.columns([1, 4])
live = c[0].toggle("Live", **kept("blocks_live", True))
group = c[1].radio(
    "KV group", groups, horizontal=True, **kept("blocks_group", groups[0]),
    help="Full-attention layers and sliding-window layers keep separate pools and tables",
) if len(groups) > 1 else groups[0]
interval = (REFRESH_S * 2 if num_blocks <= LARGE_POOL else REFRESH_S * 5) if live else None


@st.fragment(run_every=interval)
def pool_view() -> None:
    snapshot = engine.snapshot()
    blocks = sorted((b for b in snapshot.blocks if b.group == group), key=lambda b: b.block_id)
    st.markdown(charts.legend_markdown(block_counts(blocks)), unsafe_allow_html=True)
    st.plotly_chart(
        charts.block_grid(blocks, block_size, selected=state.get("blocks_inspect_id")),
        key="blocks_grid",
        on_select=on_grid_select,
        selection_mode="points",
        width="content",
        config={"displayModeBar": False, "scrollZoom": False},
    )
    block_id = st.number_input("Block id", 0, num_blocks - 1, step=1, width=240, **kept("blocks_inspect_id", 0))
    inspect(blocks[int(block_id)], snapshot.time)


def inspect(block, now: float) -> None:
    st.markdown(f"#### Block {block.block_id} — {block_category(block)}")
    c = st.columns(4)
    c[0].metric("Reference count", block.ref_count)
    c[1].metric("Tokens", f"{block.num_tokens}/{block_size}")
    c[2].metric("Prefix hits", block.hit_count)
    c[3].metric("Age", age(block.created_at, now) if block.created_at else "—", help="Since it was last handed out")
    left, right = st.columns(2)
    with left:
        st.markdown(
            f"positions **{block.start_pos}–{block.start_pos + max(block.num_tokens, 1) - 1}** · "
            f"last used {fmt_time(block.last_used) if block.last_used else '—'}  \n"
            f"holders: {', '.join(f'`{h}`' for h in block.holders) or 'none'}  \n"
            f"key `{block.key or '— (not in the prefix index)'}`  \nparent key `{block.parent_key or '—'}`"
        )
        if block.num_tokens:
            st.markdown("Decoded tokens")
            st.code(decode(tokenizer, block.token_ids), language=None, wrap_lines=True)
            with st.expander("Token by token"):
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
    with right:
        block_history(block)


def block_history(block) -> None:
    events = console.recent.for_block(block.block_id, block.group)
    cows = [e for e in events if e.kind.value == "cow"]
    st.markdown(f"**Copy-on-write history** ({len(cows)} in the last {console.recent.capacity:,} block events)")
    if cows:
        st.dataframe(
            pd.DataFrame(
                {
                    "time": [fmt_time(e.time) for e in cows],
                    "step": [e.step for e in cows],
                    "request": [e.request_id for e in cows],
                    "copied": [
                        f"block {e.detail.get('src_block')} → block {e.detail.get('dst_block')}" for e in cows
                    ],
                    "slots": [e.detail.get("num_slots") for e in cows],
                }
            ),
            hide_index=True,
        )
    else:
        st.caption("No copy-on-write involving this block.")
    with st.expander(f"All recent events of this block ({len(events)})"):
        st.dataframe(
            pd.DataFrame(
                {
                    "time": [fmt_time(e.time) for e in events],
                    "step": [e.step for e in events],
                    "kind": [e.kind.value for e in events],
                    "request": [e.request_id for e in events],
                    "detail": [", ".join(f"{k}={v}" for k, v in e.detail.items()) for e in events],
                }
            ),
            hide_index=True,
        )


pool_view()

st.subheader("Block tables side by side")
st.caption(
    "Each row is a request's block table by logical block index; equal ids in a column are one shared "
    "physical block. Where a fork's row turns to a different id, copy-on-write gave it its own block."
)
views = sorted(engine.requests(), key=lambda r: -r.arrival_time)
with_tables = [r.request_id for r in views if r.block_tables.get(group)]
if "blocks_tables" not in state:
    state["blocks_tables"] = [r.request_id for r in views if r.status in HOLDING][:4]
state["blocks_tables"] = [rid for rid in state["blocks_tables"] if rid in with_tables]
picked = st.multiselect("Requests", with_tables, **kept("blocks_tables", []), placeholder="Pick requests to compare")
if picked:
    by_id = {r.request_id: r for r in engine.requests()}
    rows = [by_id[rid] for rid in picked if rid in by_id]
    alignment = align_tables(rows, group)
    st.plotly_chart(charts.table_alignment(alignment), key="blocks_alignment")
    first = alignment.request_ids[0]
    summary = pd.DataFrame(
        {
            "request": alignment.request_ids,
            "status": [r.status for r in rows],
            "blocks": [len(r.block_tables.get(group, ())) for r in rows],
            "shared with " + first: [
                sum(1 for a, b in zip(alignment.block_ids[0], row) if a is not None and a == b) for row in alignment.block_ids
            ],
            "diverges from " + first + " at block": [
                "—" if alignment.divergence[rid] is None else str(alignment.divergence[rid]) for rid in alignment.request_ids
            ],
            "cow copies": [r.cow_copies for r in rows],
        }
    )
    st.table(summary)
else:
    st.caption("No request selected (finished requests keep the table they ended with).")
