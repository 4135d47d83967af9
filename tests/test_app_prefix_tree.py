"""Prefix tree page: the cached prefixes as an icicle, and one prefix inspected end to end."""

from __future__ import annotations

import html
import json

from app.prompting import decode
from engine.core.request import SamplingParams
from tests.test_app_support import console_env, host, no_exceptions, open_page, texts, wait_idle  # noqa: F401

PARAMS = SamplingParams(max_new_tokens=2, ignore_eos=True)


def test_an_empty_cache_says_so(console_env):
    at = open_page("prefix_tree")
    no_exceptions(at)
    assert "The prefix cache is empty" in texts(at)


def test_tree_branches_where_prompts_diverge(console_env):
    engine = host().console.engine
    shared = list(range(100, 132))  # two full blocks both prompts share
    engine.submit(shared + list(range(200, 216)) + [1], PARAMS)
    engine.submit(shared + list(range(300, 316)) + [1], PARAMS)
    wait_idle()
    at = open_page("prefix_tree")
    no_exceptions(at)
    figure = json.loads(at.get("plotly_chart")[0].proto.spec)
    icicle = figure["data"][0]
    assert icicle["type"] == "icicle"
    keyed = {b.key: b for b in engine.snapshot().blocks if b.key}
    assert len(keyed) == 4  # 2 shared + one own block each
    ids, parents = icicle["ids"], icicle["parents"]
    # The two shared blocks as one tile (no branch between them) at the root, one tile per branch; their one
    # namespace is no tile of its own (it would take a column of the width).
    assert len(ids) == 3 and parents[0] == "" and "namespace" in icicle["hovertext"][0]
    children_of = {}
    for node, parent in zip(ids, parents):
        children_of.setdefault(parent, []).append(node)
    second = next(k for k, b in keyed.items() if b.start_pos == 16)
    assert len(children_of[second]) == 2  # the branch point
    assert "4 cached blocks in 1 namespace(s), drawn as 3 tiles." in texts(at)


def test_a_long_single_chain_is_one_labelled_tile_on_a_scale_from_zero(console_env):
    """Regression: a 20-block chain was a staircase of one tile per block, cut off after ten levels, with
    a colour scale centred on 0 (-0.4 to 0.4) when no block had been hit."""
    engine = host().console.engine
    prompt = list(range(1000, 1320)) + [1]  # 20 full blocks
    engine.submit(prompt, PARAMS)
    wait_idle()
    at = open_page("prefix_tree")
    icicle = json.loads(at.get("plotly_chart")[0].proto.spec)["data"][0]
    assert len(icicle["ids"]) == 1  # one tile, the root (its namespace has no tile of its own)
    label = icicle["labels"][0]
    assert label.startswith("#0…#19 (20 blocks)")
    assert html.escape(decode(host().console.tokenizer, list(range(1000, 1016))).strip()[:10]) in label
    assert (icicle["marker"]["cmin"], icicle["marker"]["cmax"]) == (0, 1)
    assert "20 cached blocks in 1 namespace(s), drawn as 1 tiles." in texts(at)


def test_colouring_by_holders_shows_fork_sharing(console_env):
    engine = host().console.engine
    parent = engine.submit(list(range(100, 133)), PARAMS, retain=True)  # 2 full blocks and a tail
    wait_idle()
    engine.fork_many(parent, [[5], [6]], PARAMS, retain=True)
    wait_idle()
    at = open_page("prefix_tree")
    at.radio(key="tree_colour").set_value("holders now (fork sharing)").run()
    no_exceptions(at)
    icicle = json.loads(at.get("plotly_chart")[0].proto.spec)["data"][0]
    assert icicle["marker"]["colors"] == [3] and "held by 3" in icicle["labels"][0]
    assert icicle["marker"]["colorbar"]["title"]["text"] == "holders"


def test_inspecting_a_prefix_decodes_its_whole_chain(console_env):
    engine = host().console.engine
    prompt = list(range(100, 148)) + [1]  # three full blocks
    engine.submit(prompt, PARAMS)
    wait_idle()
    at = open_page("prefix_tree")
    deepest = next(b for b in engine.snapshot().blocks if b.key and b.start_pos == 32)
    at.selectbox(key="tree_pick").select(deepest.key).run()
    chain = at.table[0].value
    assert [int(b) for b in chain["block"]] == [engine.get("req-0").block_table[i] for i in range(3)]
    assert decode(host().console.tokenizer, list(range(100, 148))) in [c.value for c in at.code]


def test_many_branches_grow_the_tree_so_each_label_keeps_a_readable_line(console_env):
    """Regression (issue 47, item 14): after 50 requests sharing a prompt the labels were drawn at about
    6 px in a 560 px figure, and the namespace and the shared prompt took two thirds of the width. The
    shared prompt is now the root (its namespace no column), the figure grows until every branch gets a
    line, labels never shrink under 10 px, and siblings are labelled from where their texts part."""
    console_env(num_blocks=256)
    engine = host().console.engine
    shared = list(range(100, 132))  # two full blocks every request shares
    for n in range(40):
        engine.submit(shared + [500, 501, 502, 503] + [1000 + n] * 12 + [1], PARAMS)
    wait_idle()
    at = open_page("prefix_tree")
    no_exceptions(at)
    figure = json.loads(at.get("plotly_chart")[0].proto.spec)
    icicle, layout = figure["data"][0], figure["layout"]
    assert len(icicle["ids"]) == 41 and icicle["parents"].count("") == 1  # one root column, then the branches
    assert layout["uniformtext"] == {"minsize": 10, "mode": "hide"}
    plot_px = layout["height"] - layout["margin"]["t"] - layout["margin"]["b"]
    assert plot_px / 40 >= 22  # 40 equal branches: a line of a 12 px label each
    tokenizer = host().console.tokenizer
    own = html.escape(decode(tokenizer, [1000 + 7] * 12).strip()[:10])
    common = html.escape(decode(tokenizer, [500, 501, 502, 503]).strip())
    branch = next(label for label in icicle["labels"] if own in label)
    assert f"…{own}" in branch
    assert common not in branch  # the four tokens every sibling starts with are left out


def test_several_top_tiles_hang_from_their_namespace_tile(console_env):
    engine = host().console.engine
    engine.submit(list(range(100, 116)) + [1], PARAMS)
    engine.submit(list(range(200, 216)) + [1], PARAMS)
    wait_idle()
    at = open_page("prefix_tree")
    icicle = json.loads(at.get("plotly_chart")[0].proto.spec)["data"][0]
    assert icicle["ids"][0].startswith("namespace ") and icicle["parents"] == ["", icicle["ids"][0], icicle["ids"][0]]
