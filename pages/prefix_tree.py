"""Prefix tree: the cached prefixes as a tree of blocks, sized by tokens and coloured by hits."""

from __future__ import annotations

import html

import pandas as pd
import streamlit as st

from app import charts
from app.frames import block_category, prefix_chain, prefix_tree
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
    "Every block in the prefix index, hanging from its chain parent; the roots are cache namespaces "
    "(model, weights, dtype, block size, tenant salt). Width is tokens, colour is prefix hits. "
    "Hover a node for its decoded tokens; click to zoom into a subtree."
)
c = st.columns([1, 1, 3])
if state.get("tree_group") not in groups:
    state["tree_group"] = groups[0]
group = c[2].radio("KV group", groups, horizontal=True, **kept("tree_group", groups[0])) if len(groups) > 1 else groups[0]
limit = c[0].number_input("Most nodes drawn", 100, 20_000, step=100, **kept("tree_limit", 2_000))
live = c[1].toggle("Live", **kept("tree_live", False), help="Redraws reset the zoom")


def hover_text(block) -> str:
    text = html.escape(decode(tokenizer, block.token_ids)).replace("\n", "↵<br>")
    return (
        f"block {block.block_id} · positions {block.start_pos}–{block.start_pos + block.num_tokens - 1}<br>"
        f"hits {block.hit_count} · ref count {block.ref_count} · {block_category(block)}<br>{text}"
    )


@st.fragment(run_every=REFRESH_S * 5 if live else None)
def tree() -> None:
    blocks = [b for b in engine.snapshot().blocks if b.group == group]
    nodes, roots, dropped = prefix_tree(blocks, int(limit))
    if not nodes:
        st.info("The prefix cache is empty: full blocks enter it once their KV is computed.")
        return
    used_roots = sorted({n.parent for n in nodes if n.parent in set(roots)})
    root_ids = {r: f"namespace {r[:8]}" for r in used_roots}
    ids = list(root_ids.values()) + [n.key for n in nodes]
    parents = [""] * len(root_ids) + [root_ids.get(n.parent, n.parent) for n in nodes]
    labels = list(root_ids.values()) + [f"#{n.block.block_id}" for n in nodes]
    values = [0] * len(root_ids) + [n.block.num_tokens for n in nodes]
    hits = [0] * len(root_ids) + [n.block.hit_count for n in nodes]
    hover = [f"cache namespace {r}" for r in root_ids] + [hover_text(n.block) for n in nodes]
    st.plotly_chart(charts.prefix_icicle(ids, parents, labels, values, hits, hover), key="tree_icicle")
    total = len(nodes) + dropped
    st.caption(
        f"{total:,} cached blocks in {len(used_roots)} namespace(s)"
        + (f"; the {dropped:,} deepest are not drawn (raise 'Most nodes drawn')." if dropped else ".")
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
        format_func=lambda k: f"#{by_key[k].block.block_id} · positions up to "
        f"{by_key[k].block.start_pos + by_key[k].block.num_tokens} · hits {by_key[k].block.hit_count}",
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
