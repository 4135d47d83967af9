"""Prefix tree: the cached prefixes as a tree of blocks, sized by tokens, coloured by hits or holders."""

from __future__ import annotations

import html

import pandas as pd
import streamlit as st

from app import charts
from app.frames import PrefixRun, block_category, prefix_chain, prefix_runs, prefix_tree, sibling_common_prefix, tree_shape
from app.hosting import get_host
from app.prompting import decode
from app.ui import REFRESH_S, kept

host = get_host()
console = host.console
engine = console.engine
tokenizer = console.tokenizer
groups = [g.name for g in engine.stats().groups] or ["full"]
state = st.session_state

st.title("Prefix tree")
st.caption(
    "Every block in the prefix index, hanging from its chain parent, under its cache namespace (model, "
    "weights, dtype, block size, tenant salt). Height is tokens. A stretch of blocks without a branch (and "
    "with one hit count and one holder count) is one tile, labelled with its text from where it differs "
    "from its siblings. Hover a tile for its blocks and decoded tokens; click to zoom into a subtree."
)
COLOUR_BY = {"prefix hits": "hits", "holders now (fork sharing)": "holders"}
c = st.columns([1, 1, 2, 2])
if state.get("tree_group") not in groups:
    state["tree_group"] = groups[0]
group = c[3].radio("KV group", groups, horizontal=True, **kept("tree_group", groups[0])) if len(groups) > 1 else groups[0]
limit = c[0].number_input("Most blocks drawn", 100, 20_000, step=100, **kept("tree_limit", 2_000))
live = c[1].toggle("Live", **kept("tree_live", False), help="Redraws reset the zoom")
colour_by = c[2].radio(
    "Colour by", list(COLOUR_BY), horizontal=True, **kept("tree_colour", "prefix hits"),
    help="Prefix hits: index lookups that reused the block. Holders: requests whose tables point at it now; "
    "above 1 it is shared (by forks or by requests running on a hit).",
)
SNIPPET_CHARS = 40  # of a tile's decoded text in its label
MAX_LEVELS = 6  # tile columns drawn at once: deeper levels show when a tile is clicked
MIN_TILE_PX = 22  # the height the smallest drawn tile gets: one line of a 12 px label
TWO_LINES_PX = 36  # a tile at least this tall gets its ids and its text on two lines
HEIGHT_PX = (560, 2_400)  # least and most height of the tree's plot area


def run_label(run: PrefixRun, skip: int, tile_px: float) -> str:
    """The tile's ids and its text from token `skip` of its first block (where its siblings' texts part);
    on one line when the tile is too short for two."""
    first, last = run.blocks[0], run.blocks[-1]
    ids = f"#{first.block_id}" if len(run.blocks) == 1 else f"#{first.block_id}…#{last.block_id} ({len(run.blocks)} blocks)"
    shared = f" · held by {first.ref_count}" if first.ref_count > 1 else ""
    text = decode(tokenizer, first.token_ids[skip:]).replace("\n", "↵").strip()
    snippet = ("…" if skip else "") + (text if len(text) <= SNIPPET_CHARS else text[: SNIPPET_CHARS - 1] + "…")
    return f"{ids}{shared}{'<br>' if tile_px >= TWO_LINES_PX else ' · '}{html.escape(snippet)}"


def run_hover(run: PrefixRun) -> str:
    first, last = run.blocks[0], run.blocks[-1]
    tokens = [t for b in run.blocks for t in b.token_ids]
    text = html.escape(decode(tokenizer, tokens)).replace("\n", "↵<br>")
    if len(text) > 600:
        text = text[:600] + "…"
    blocks = ", ".join(f"#{b.block_id}" for b in run.blocks[:12]) + (" …" if len(run.blocks) > 12 else "")
    return (
        f"blocks {blocks} · positions {first.start_pos}–{last.start_pos + last.num_tokens - 1}<br>"
        f"prefix hits {first.hit_count} · holders {first.ref_count} · {block_category(first)}<br>{text}"
    )


@st.fragment(run_every=REFRESH_S * 5 if live else None)
def tree() -> None:
    blocks = [b for b in engine.snapshot().blocks if b.group == group]
    nodes, roots, dropped = prefix_tree(blocks, int(limit))
    if not nodes:
        st.info("The prefix cache is empty: full blocks enter it once their KV is computed.")
        return
    runs = prefix_runs(nodes)
    shape = tree_shape(runs, roots, MAX_LEVELS, MIN_TILE_PX, HEIGHT_PX)
    skips = sibling_common_prefix(runs)
    by = COLOUR_BY[colour_by]
    ns_ids = {ns: f"namespace {ns[:8]}" for ns in shape.namespaces}
    ids = list(ns_ids.values()) + [run.key for run in runs]
    parents = [""] * len(ns_ids) + [ns_ids.get(shape.parent_of[run.key], shape.parent_of[run.key]) for run in runs]
    labels = list(ns_ids.values()) + [run_label(run, skips[run.key], shape.tile_px.get(run.key, 0.0)) for run in runs]
    values = [0] * len(ns_ids) + [run.num_tokens for run in runs]
    colour = [0] * len(ns_ids) + [run.blocks[0].hit_count if by == "hits" else run.blocks[0].ref_count for run in runs]
    hover = [f"cache namespace {ns}" for ns in ns_ids] + [
        ("" if shape.parent_of[run.key] else f"cache namespace {run.parent}<br>") + run_hover(run) for run in runs
    ]
    figure = charts.prefix_icicle(
        ids, parents, labels, values, colour, hover, by, height_px=shape.height_px, max_levels=MAX_LEVELS
    )
    st.plotly_chart(figure, key="tree_icicle")
    used_roots = sorted({r.parent for r in runs if r.parent in set(roots)})
    total = len(nodes) + dropped
    st.caption(
        f"{total:,} cached blocks in {len(used_roots)} namespace(s), drawn as {len(runs):,} tiles"
        + (f"; the {dropped:,} deepest are not drawn (raise 'Most blocks drawn')" if dropped else "")
        + (f"; {MAX_LEVELS} of {shape.depth} levels show at once: click a tile to go deeper." if shape.depth > MAX_LEVELS else ".")
    )

    st.subheader("Inspect a prefix")
    ranked = sorted(nodes, key=lambda n: (-n.block.hit_count, n.block.start_pos))
    by_key = {n.key: n for n in ranked}
    if state.get("tree_pick") not in by_key:
        state["tree_pick"] = ranked[0].key
    key = st.selectbox(
        "Prefix ending at block",
        list(by_key),
        **kept("tree_pick", ranked[0].key),
        # Stable labels (no hit count): Streamlit keeps a selectbox's value as its label.
        format_func=lambda k: f"#{by_key[k].block.block_id} · positions up to "
        f"{by_key[k].block.start_pos + by_key[k].block.num_tokens}",
    )
    chain = prefix_chain(blocks, key)
    st.table(
        pd.DataFrame(
            {
                "block": [b.block_id for b in chain],
                "positions": [f"{b.start_pos}–{b.start_pos + b.num_tokens - 1}" for b in chain],
                "hits": [b.hit_count for b in chain],
                "ref count": [b.ref_count for b in chain],
                "state": [block_category(b) for b in chain],
                "key": [b.key[:16] + "…" for b in chain],
            }
        )
    )
    st.markdown("Decoded prefix")
    st.code(decode(tokenizer, [t for b in chain for t in b.token_ids]), language=None, wrap_lines=True)


tree()
