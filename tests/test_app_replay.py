"""Replay page: the hit, window state, replayed span and computed suffix of every request."""

from __future__ import annotations

import json

from engine.core.request import SamplingParams
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
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    bars = {trace["name"]: trace for trace in spec["data"]}
    assert list(bars) == ["hit, reused [0, r)", "replayed [r, h)", "computed suffix", "window state [s, e)"]
    # Regression (issue 15): the window-state band was drawn under the replay bar, at the same place, so
    # the bar hid it; and the legend sat on the x axis.
    band, replayed = bars["window state [s, e)"], bars["replayed [r, h)"]
    assert band["offset"] >= replayed["offset"] + replayed["width"]  # below the bar, not under it
    assert spec["layout"]["legend"]["y"] > 1 and spec["layout"]["legend"]["yanchor"] == "bottom"
    # Nothing was verified: no divergence columns, and no literal "None" anywhere.
    assert "mean KL" not in frame.columns and "None" not in frame.astype(str).to_numpy()
    assert [m.label for m in at.metric][:1] == ["Window W"]
    # Why the exact replay saved nothing, in a sentence, with what would have made the state ready.
    said = next(m.value for m in at.markdown if m.value.startswith("**reader** · exact replay"))
    assert "the hit reached h = 36" in said and "where the 8-token window needs [28, 36) (8 tokens)" in said
    assert "it recomputed [0, 36) and saved nothing. Ready state needed" in said
