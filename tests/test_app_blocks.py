"""Blocks page: the live grid, the block inspector and block tables side by side."""

from __future__ import annotations

import dataclasses

from app.prompting import decode
from engine.request import SamplingParams
from tests.test_app_support import console_env, host, no_exceptions, open_page, texts, wait_idle  # noqa: F401

PARAMS = SamplingParams(max_new_tokens=3, ignore_eos=True)


def fork_twice() -> tuple[str, str, str]:
    engine = host().console.engine
    parent = engine.submit(list(range(10, 50)), PARAMS, retain=True)  # 40 tokens: 2 full blocks + a tail
    wait_idle()
    a = engine.fork(parent, [5], PARAMS, retain=True)
    b = engine.fork(parent, [6], PARAMS, retain=True)
    wait_idle()
    return parent, a, b


def test_blocks_page_draws_every_block_as_one_chart(console_env):
    at = open_page("blocks")
    no_exceptions(at)
    charts = at.get("plotly_chart")
    assert len(charts) == 1  # the grid: one chart for the whole pool, no widget per block
    assert "**free**: 64" in texts(at)


def test_inspecting_a_shared_block_shows_its_reference_count_and_holders(console_env):
    parent, a, b = fork_twice()
    engine = host().console.engine
    shared = engine.get(parent).block_table[0]
    at = open_page("blocks")
    assert "**referenced ×3**: 2" in texts(at)  # the two full blocks all three requests share
    at.number_input(key="blocks_inspect_id").set_value(shared).run()
    no_exceptions(at)
    values = {m.label: m.value for m in at.metric}
    assert (values["Reference count"], values["Tokens"]) == ("3", "16/16")
    assert f"holders: `{parent}`, `{a}`, `{b}`" in texts(at)
    assert decode(host().console.tokenizer, list(range(10, 26))) in texts(at)


def test_copy_on_write_shows_in_the_inspector_and_where_block_tables_diverge(console_env):
    parent, a, b = fork_twice()
    engine = host().console.engine
    tail = engine.get(a).block_table[2]
    assert engine.get(a).cow_copies == 1 and tail != engine.get(parent).block_table[2]
    at = open_page("blocks")
    at.number_input(key="blocks_inspect_id").set_value(tail).run()
    cow = next(d.value for d in at.dataframe if "copied" in d.value.columns)
    assert list(cow["request"]) == [a]
    assert list(cow["copied"]) == [f"block {engine.get(parent).block_table[2]} → block {tail}"]

    assert at.multiselect(key="blocks_tables").value == [b, a, parent]
    summary = at.table[0].value
    assert list(summary["request"]) == [b, a, parent]
    assert list(summary[f"shared with {b}"]) == [3, 2, 2]
    assert list(summary[f"diverges from {b} at block"]) == ["—", "2", "2"]
    assert len(at.get("plotly_chart")) == 2  # the grid and the side-by-side tables


def test_a_hybrid_model_shows_each_kv_group_pool(console_env):
    console = host().restart(dataclasses.replace(host().console.config, attention_override="hybrid:8"))
    assert [g.name for g in console.engine.stats().groups] == ["full", "sliding"]
    rid = console.engine.submit(list(range(10, 50)), PARAMS, retain=True)
    wait_idle()
    at = open_page("blocks")
    no_exceptions(at)
    assert at.radio(key="blocks_group").options == ["full", "sliding"]
    full_legend = texts(at)
    at.radio(key="blocks_group").set_value("sliding").run()
    no_exceptions(at)
    sliding = console.engine.get(rid).block_tables["sliding"]
    at.number_input(key="blocks_inspect_id").set_value(sliding[-1]).run()
    assert "holders: `req-0`" in texts(at) and texts(at) != full_legend
    assert at.table[0].value["blocks"].tolist() == [len(sliding)]
    overview = open_page("overview", at)
    assert overview.table[0].value["KV group"].tolist() == ["full", "sliding"]
    tree = open_page("prefix_tree", overview)
    tree.radio(key="tree_group").set_value("sliding").run()
    no_exceptions(tree)
