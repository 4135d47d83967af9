"""Prefix tree page: the cached prefixes as an icicle, and one prefix inspected end to end."""

from __future__ import annotations

import json

from app.prompting import decode
from engine.request import SamplingParams
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
    assert len(ids) == 5 and parents[0] == ""  # one namespace root + 4 blocks
    children_of = {}
    for node, parent in zip(ids, parents):
        children_of.setdefault(parent, []).append(node)
    second = next(k for k, b in keyed.items() if b.start_pos == 16)
    assert len(children_of[second]) == 2  # the branch point
    assert "3 cached blocks" not in texts(at) and "4 cached blocks in 1 namespace(s)." in texts(at)


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
