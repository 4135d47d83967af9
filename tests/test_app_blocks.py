"""Blocks page: the live grid, the block inspector, a block's life from the history, a request's blocks
over time, block tables side by side, and the guided scenario "Sharing and copy-on-write"."""

from __future__ import annotations

import dataclasses
import json

from engine.core.request import SamplingParams
from storage.read.block_history import EVICTABLE_FROM_HERE, SAFE_TO_REUSE
from tests.test_app_support import (  # noqa: F401  (console_env is a fixture)
    console_env,
    flush_history,
    host,
    no_exceptions,
    open_page,
    texts,
    wait_idle,
)

PARAMS = SamplingParams(max_new_tokens=3, ignore_eos=True)


def fork_twice() -> tuple[str, str, str]:
    engine = host().console.engine
    parent = engine.submit(list(range(10, 50)), PARAMS, retain=True)  # 40 tokens: 2 full blocks + a tail
    wait_idle()
    a, b = engine.fork_many(parent, [[5], [6]], PARAMS, retain=True)
    wait_idle()
    return parent, a, b


def exercise() -> tuple[str, str, str]:
    """Issue 15's exercise: a retained parent of one full and one half-full block (24 tokens), two forks
    appending different tokens, then the parent's release."""
    engine = host().console.engine
    parent = engine.submit(list(range(100, 124)), SamplingParams(max_new_tokens=1, ignore_eos=True), retain=True)
    wait_idle()
    a, b = engine.fork_many(parent, [[7], [8]], SamplingParams(max_new_tokens=2, ignore_eos=True), retain=True)
    wait_idle()
    engine.release(parent)
    flush_history()
    return parent, a, b


def charts(at) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def timeline_rows(figure: dict) -> dict[str, dict]:
    """Per subplot title ("block 5: ..."): the count line's y values and the marker words drawn in it."""
    annotations = figure["layout"].get("annotations", [])
    titles = [a for a in annotations if a.get("text", "").startswith("block ")]
    rows: dict[str, dict] = {}
    for index, title in enumerate(titles, start=1):
        axis = "y" if index == 1 else f"y{index}"
        lines = [t for t in figure["data"] if t.get("mode") == "lines" and t.get("yaxis", "y") == axis]
        words = [a["text"] for a in annotations if a.get("yref") == axis and a.get("showarrow")]
        rows[title["text"]] = {"counts": lines[0]["y"][1:-1], "markers": words}
    return rows


def test_blocks_page_draws_every_block_as_one_chart(console_env):
    at = open_page("blocks")
    no_exceptions(at)
    assert len(charts(at)) == 1  # the grid: one chart for the whole pool, no widget per block
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
    assert f"holders: `{parent}` (retained), `{a}` (retained), `{b}` (retained)" in texts(at)


def test_the_grid_names_each_blocks_holders_and_outlines_a_highlighted_request(console_env):
    parent, a, b = fork_twice()
    engine = host().console.engine
    at = open_page("blocks")
    grid = charts(at)[0]
    hover = [text for trace in grid["data"] for text in trace.get("hovertext") or []]
    assert any(f"holders: {parent} (retained), {a} (retained), {b} (retained)" in text for text in hover)
    assert any("free: holds nothing" in text for text in hover)
    at.selectbox(key="blocks_highlight").select(a).run()
    outline = next(t for t in charts(at)[0]["data"] if t.get("name") == "highlighted")
    columns = 12  # the grid of 64 blocks
    assert sorted(int(y) * columns + int(x) for x, y in zip(outline["x"], outline["y"])) == sorted(engine.get(a).block_table)
    assert f"**{a}** holds blocks" in texts(at)


def test_a_blocks_life_draws_the_exercise_from_the_history(console_env):
    """The exercise's shared tail: 1, then 3 after two forks, 2 at the first child's copy-on-write, 1 at
    the second's, 0 at the parent's release, marked "no holder left: safe to reuse"."""
    parent, a, b = exercise()
    engine = host().console.engine
    tail = engine.get(parent).block_table[1]
    at = open_page("blocks")
    at.number_input(key="blocks_inspect_id").set_value(tail).run()
    no_exceptions(at)
    life = next(c for c in charts(at) if f"block {tail}" in [x.get("text") for x in c["layout"].get("annotations", [])])
    row = timeline_rows(life)[f"block {tail}"]
    assert row["counts"] == [1, 2, 3, 2, 1, 0]
    assert [f"<b>{SAFE_TO_REUSE}</b>"] == row["markers"]
    table = next(d.value for d in at.dataframe if "what happened" in d.value.columns)
    assert table["ref count"].tolist() == [1, 2, 3, 2, 1, 0]
    assert table["event"].tolist() == ["allocate", "fork", "fork", "cow", "cow", "release"]
    copy_a = engine.get(a).block_table[1]
    assert table["what happened"].tolist()[3] == f"copy-on-write: {a} moved to its copy, block {copy_a} (8 slots copied)"
    assert table["what happened"].tolist()[5] == f"released by {parent} — {SAFE_TO_REUSE}"
    assert table["holders after"].tolist() == [parent, f"{parent}, {a}", f"{parent}, {a}, {b}", f"{parent}, {b}", parent, "none"]
    assert "only one holder may ever append in place" in texts(at)  # why the copies happen


def test_a_requests_fork_family_stacks_the_timelines_of_its_blocks(console_env):
    parent, a, b = exercise()
    engine = host().console.engine
    at = open_page("blocks")
    at.selectbox(key="blocks_family_pick").select(b).run()
    no_exceptions(at)
    stacked = next(c for c in charts(at) if len(timeline_rows(c)) == 3)
    rows = timeline_rows(stacked)
    full, tail = engine.get(parent).block_table[:2]
    assert list(rows)[:2] == [f"block {full}", f"block {tail}"]  # lives that differ first
    assert rows[f"block {full}"]["counts"] == [1, 1, 2, 3, 2]  # allocated, cached, two forks, the parent left
    assert rows[f"block {tail}"]["counts"] == [1, 2, 3, 2, 1, 0]
    copies = sorted((engine.get(a).block_table[1], engine.get(b).block_table[1]))
    # a's copy and b's copy, still held, lived the same life: drawn once, with the count
    assert rows[f"block {copies[0]}, {copies[1]} (2 blocks, one life)"]["counts"] == [1]
    assert f"3 request(s): {parent}, {a}, {b}" in texts(at)


def test_block_tables_compare_each_child_with_its_parent_and_mark_released_rows(console_env):
    parent, a, b = fork_twice()
    engine = host().console.engine
    at = open_page("blocks")
    assert at.multiselect(key="blocks_tables").value == [b, a, parent]
    summary = at.table[0].value
    assert list(summary["request"]) == [parent, a, b]  # the parent first, not the newest request
    assert list(summary["parent"]) == ["—", parent, parent]
    assert list(summary["shared with its parent"]) == ["—", "2", "2"]
    assert list(summary["diverges from its parent at block"]) == ["—", "2", "2"]
    engine.release(parent)
    at.run()
    summary = at.table[0].value
    assert list(summary["holds its blocks"]) == ["no", "yes", "yes"]
    alignment = next(c for c in charts(at) if c["data"][0]["type"] == "heatmap")["data"][0]
    assert alignment["z"][0] == [0, 0, 0]  # the released parent's row shades nothing as shared
    assert alignment["y"][0] == f"{parent} (holds nothing now)"


def test_a_free_block_shows_no_stale_tokens(console_env):
    parent, _, _ = fork_twice()
    engine = host().console.engine
    tail = engine.get(parent).block_table[2]
    engine.release(parent)
    at = open_page("blocks")
    at.number_input(key="blocks_inspect_id").set_value(tail).run()
    assert "It holds nothing" in texts(at)
    assert {m.label: m.value for m in at.metric}["Tokens"] == "0/16"


def test_the_guided_scenario_plays_the_exercise_and_leaves_everyone_elses_state_alone(console_env):
    engine = host().console.engine
    other = engine.submit(list(range(300, 340)), PARAMS, retain=True)  # another operator's retained request
    wait_idle()
    before = {v.block_id: (v.ref_count, v.key) for v in engine.snapshot().blocks if v.ref_count or v.key}
    at = open_page("blocks")
    at.button(key="blocks_scenario_go").click().run(timeout=180)
    no_exceptions(at)
    run = at.session_state["blocks_scenario"]
    assert run.done and len(run.blocks) == 4
    rows = timeline_rows(next(c for c in charts(at) if len(timeline_rows(c)) == 4))
    full, tail, copy_a, copy_b = run.blocks
    assert rows[f"block {tail}: the parent's half-full tail"]["counts"] == [1, 2, 3, 2, 1, 0]
    assert rows[f"block {tail}: the parent's half-full tail"]["markers"] == [f"<b>{SAFE_TO_REUSE}</b>"]
    assert rows[f"block {full}: the full block, shared"]["counts"] == [1, 1, 2, 3, 2, 1, 0]
    assert rows[f"block {full}: the full block, shared"]["markers"] == [f"<b>{EVICTABLE_FROM_HERE}</b>"]
    for copy in (copy_a, copy_b):
        title = next(t for t in rows if t.startswith(f"block {copy}:"))
        assert rows[title]["counts"] == [1, 0] and rows[title]["markers"] == [f"<b>{SAFE_TO_REUSE}</b>"]
    page = texts(at)
    assert "go to reference count 3" in page and "may be forked again" in page and "safe to reuse" in page
    # The engine is as the scenario found it: the other request and its blocks untouched, nothing held.
    assert engine.get(other).status == "retained"
    after = {v.block_id: (v.ref_count, v.key) for v in engine.snapshot().blocks if v.ref_count}
    assert after == {b: state for b, state in before.items() if state[0]}
    assert all(engine.get(rid).status == "released" for rid in run.request_ids)
    assert engine.stats().evictions == 0


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
    assert "holders: `req-0` (retained)" in texts(at) and texts(at) != full_legend
    assert at.table[0].value["blocks"].tolist() == [len(sliding)]
    overview = open_page("overview", at)
    assert overview.table[0].value["KV group"].tolist() == ["full", "sliding"]
    tree = open_page("prefix_tree", overview)
    tree.radio(key="tree_group").set_value("sliding").run()
    no_exceptions(tree)
