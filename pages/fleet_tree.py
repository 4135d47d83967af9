"""Fleet prefix tree: the prefixes every pod holds, merged by token content — which pods hold each one."""

from __future__ import annotations

import html
import time

import streamlit as st

from app import fleet_charts
from app.fleet_hosting import get_fleet_host
from app.fleet_view import index_from_history, media_and_groups, tree_frame
from app.hosting import get_host
from app.prompting import decode
from app.ui import LIVE, fleet_source, kept, read_history


BIG_CHAINS = 8  # the first blocks of this many of the longest chains are labelled with their text

host = get_host()
fleet = get_fleet_host()
tokenizer = host.console.tokenizer
state = st.session_state

st.title("Fleet prefix tree")
st.caption(
    "Blocks at the same place (parent hash) with the same tokens are one prefix across pods; a node's "
    "width is its tokens, its colour what you choose (pods holding it, copies, age, idle time, tokens "
    "below it). The longest chains are labelled with their first words. Prefixes only one pod holds are "
    "where a router's choice matters."
)
watch = fleet.watch
c = st.columns([3, 1, 1, 1])
view = fleet_source(c[0], "fleet_tree_view", live=watch is not None)
limit = c[1].number_input("Most nodes", 100, 20_000, step=100, **kept("fleet_tree_limit", 2_000))
colour_by = c[2].selectbox(
    "Colour by", list(fleet_charts.TREE_COLOURS), format_func=fleet_charts.TREE_COLOURS.get,
    **kept("fleet_tree_colour", "age_s"),
)  # fmt: skip
decoded = c[3].toggle("Decode tokens", **kept("fleet_tree_decode", True), help="With this console's tokenizer")
st.button("Refresh", key="fleet_tree_refresh")

now = time.time()
index = watch.index if view == LIVE and watch is not None else read_history(index_from_history, host.db, now, fleet.stale_after_s)
if index is None:
    st.stop()
summaries = index.pods(now)
places = media_and_groups(summaries)
if not places:
    st.info("No pod holds blocks yet.")
    st.stop()
labels = {place: f"{place[0]} · group {place[1]}" for place in places}
if state.get("fleet_tree_place") not in places:
    state["fleet_tree_place"] = places[0]
medium, group_idx = st.selectbox("Medium and KV group", places, format_func=labels.get, **kept("fleet_tree_place", places[0]))

tree = index.prefix_tree(medium, group_idx, max_nodes=int(limit))
frame = tree_frame(tree, now)
if frame.empty:
    st.info("No prefix is reachable from a first block in this medium and group.")
else:

    def hover(row) -> str:
        text = decode(tokenizer, row.token_ids) if decoded else " ".join(map(str, row.token_ids))
        return (
            f"depth {row.depth} · tokens up to {row.num_tokens} · {row.tokens_below:,} tokens below"
            f"<br>pods: {html.escape(row.pods)} · copies {row.copies} · age {row.age_s:,.0f} s"
            f" · idle {row.idle_s:,.0f} s<br>{html.escape(text).replace(chr(10), '↵<br>')}"
        )

    def label(row, big: set[int]) -> str:
        if row.node_id not in big:
            return f"{row.replicas} pod{'s' if row.replicas != 1 else ''}"
        text = decode(tokenizer, row.token_ids) if decoded else " ".join(map(str, row.token_ids[:8]))
        return f"{html.escape(' '.join(text.split())[:40])} · {row.tokens_below:,} tokens"

    roots = frame[frame["parent_id"].isna()]
    big = set(roots.nlargest(BIG_CHAINS, "tokens_below")["node_id"])  # the longest chains, where they start
    rows = list(frame.itertuples())
    hovers, names = [hover(row) for row in rows], [label(row, big) for row in rows]
    figure = fleet_charts.fleet_icicle(frame, hovers, names, colour_by)
    st.plotly_chart(figure, key="fleet_icicle")
    shared = frame[frame["replicas"] > 1]
    c = st.columns(4)
    c[0].metric("Prefix blocks", f"{len(frame):,}")
    c[1].metric("Held by 2+ pods", f"{len(shared):,}")
    c[2].metric("Deepest shared prefix", f"{int(shared['num_tokens'].max()) if len(shared) else 0:,} tokens")
    c[3].metric("Pods", len(summaries))
    if tree.truncated:
        st.caption(f"Cut at {int(limit):,} nodes: raise 'Most nodes' to see the rest.")
    unreachable = {pod: n for pod, n in tree.unreachable.items() if n}
    if unreachable:
        st.caption(
            "Held blocks not reachable from a first block (their parent is not held, or their tokens "
            "were not published per block): " + ", ".join(f"{pod} {n}" for pod, n in sorted(unreachable.items()))
        )
    st.subheader("Deepest prefixes and who holds them")
    table = frame.sort_values(["num_tokens", "replicas"], ascending=False).head(50).copy()
    table["text"] = [decode(tokenizer, ids)[-120:] if decoded else str(list(ids)[-16:]) for ids in table["token_ids"]]
    st.dataframe(
        table[["depth", "num_tokens", "replicas", "copies", "pods", "text"]],
        hide_index=True,
        column_config={"text": st.column_config.TextColumn("last block's text" if decoded else "last tokens")},
    )
