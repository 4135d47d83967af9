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
    # One namespace root, the two shared blocks as one tile (no branch between them), one tile per branch.
    assert len(ids) == 4 and parents[0] == ""
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
    assert len(icicle["ids"]) == 2  # the namespace and one tile
    label = icicle["labels"][1]
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
    assert icicle["marker"]["colors"][1:] == [3] and "held by 3" in icicle["labels"][1]
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
