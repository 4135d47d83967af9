"""Replay page: the hit, window state, replayed span and computed suffix of every request."""

from __future__ import annotations

import json

from engine.request import SamplingParams
from tests.test_app_support import console_env, host, no_exceptions, open_page, texts, wait_idle  # noqa: F401

PARAMS = SamplingParams(max_new_tokens=1, ignore_eos=True)


def test_full_attention_model_says_every_hit_is_ready(console_env):
    at = open_page("replay")
    no_exceptions(at)
    assert "only full-attention layers" in texts(at)


def test_hybrid_model_draws_an_exact_replay(console_env):
    console_env(block_size=4, attention="hybrid:8")
    engine = host().console.engine
    prefix = list(range(100, 140))
    engine.submit(prefix, PARAMS, request_id="doc")
    wait_idle()
    engine.submit(prefix[:36] + [7, 8, 9], PARAMS, request_id="reader")
    wait_idle()
    at = open_page("replay")
    no_exceptions(at)
    frame = at.dataframe[0].value
    reader = frame[frame["request"] == "reader"].iloc[0]
    assert (reader["mode"], reader["h"], reader["r"], reader["replayed"]) == ("exact", 36, 0, 36)
    bars = json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
    assert [trace["name"] for trace in bars] == ["hit [0, h)", "window state [s, e)", "replayed [r, h)", "computed suffix"]
    assert [m.label for m in at.metric][:1] == ["Window W"]
