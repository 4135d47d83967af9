"""Overview page: headline metrics of the shared engine and their history."""

from __future__ import annotations

import json
import time

from app.hosting import HISTORY_INTERVAL_S
from engine.core.request import SamplingParams
from tests.test_app_support import (  # noqa: F401
    console_env, flush_history, host, no_exceptions, open_page, wait_for, wait_idle,
)  # fmt: skip

LABELS = [
    "KV usage", "Blocks free", "Blocks cached", "Blocks referenced", "Sharing ratio",
    "Prefix-cache hit rate", "Fork sharing", "Tokens saved", "Prefill time saved", "Replayed tokens",
    "Copy-on-write copies", "Preemptions", "Re-prefill from cache",
    "Evictions / min", "Evictions (total)", "Window drops / min", "Running", "Waiting", "Retained",
    "Rows dropped", "Failed batches", "Queued rows", "History lag", "Events written", "Retrying", "Writer restarts",
]  # fmt: skip


def metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def test_overview_metrics_render_for_an_idle_engine(console_env):
    at = open_page("overview")
    no_exceptions(at)
    assert [m.label for m in at.metric] == LABELS
    values = metrics(at)
    assert (values["KV usage"], values["Blocks free"], values["Sharing ratio"]) == ("0.0%", "64", "1.00×")
    assert (values["Rows dropped"], values["Failed batches"], values["Writer restarts"]) == ("0", "0", "0")


def test_overview_metrics_follow_the_engine(console_env):
    engine = host().console.engine
    prompt = list(range(10, 74))  # 4 full blocks
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    parent = engine.submit(prompt, params, retain=True)
    wait_idle()
    engine.fork(parent, [5, 6], params)
    engine.fork(parent, [7, 8], params, retain=True)
    engine.submit(prompt + [9], params)  # a prefix hit on the parent's 4 cached blocks
    wait_idle()
    history = host().console.history
    # Once the newest sample is one sample interval old, the page adds a second one (so charts can draw).
    wait_for(lambda: time.time() - history.samples()[-1][0] >= HISTORY_INTERVAL_S, "a history sample interval")
    at = open_page("overview")
    values = metrics(at)
    stats = engine.stats()
    assert values["Blocks referenced"] == str(stats.used_blocks)
    assert values["KV usage"] == f"{stats.kv_usage:.1%}"
    assert values["Sharing ratio"] == f"{stats.sharing_ratio:.2f}×" and stats.sharing_ratio > 1
    assert values["Tokens saved"] == f"{stats.tokens_saved:,}" and stats.prefix_hit_tokens > 0
    assert values["Prefix-cache hit rate"] == f"{stats.prefix_hit_rate:.1%}"
    assert values["Copy-on-write copies"] == str(stats.cow_copies)
    assert values["Retained"] == "2"
    assert values["Prefill time saved"] != "—"
    assert len(at.get("plotly_chart")) >= 4  # history charts from the in-process ring buffer


def test_the_history_charts_take_a_range_and_chart_evictions_apart_from_window_drops(console_env):
    engine = host().console.engine
    engine.submit(list(range(10, 74)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    wait_idle()
    engine.reset_cache()  # evictions with reason "reset"
    flush_history()
    at = open_page("overview")
    scope = at.radio(key="overview_hit_scope")
    assert scope.options == ["Last 15 min", "Last hour", "This run", "All runs"]
    for choice in scope.options:
        at.radio(key="overview_hit_scope").set_value(choice).run()
        no_exceptions(at)
        titles = [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in at.get("plotly_chart")]
        evictions = [t for t in titles if t.startswith("Evictions and window drops per")]
        assert evictions, f"{choice}: no evictions chart in {titles}"
