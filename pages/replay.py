"""Replay: for every request, how much of its prefix hit, which window state was there, what was replayed."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app.frames import replay_sentence
from app.hosting import get_host
from app.ui import REFRESH_S

SEGMENTS = (  # (name, colour): drawn in this order, later segments on top
    ("hit, reused [0, r)", "#93c5fd"),
    ("replayed [r, h)", "#f97316"),
    ("computed suffix", "#a855f7"),
    ("window state [s, e)", "#16a34a"),
)
MAX_ROWS = 60

host = get_host()

st.title("Replay")
st.caption(
    "With sliding-window layers a prefix hit is not ready window state. Per request: the hit position h "
    "(full-layer state present), the valid window-state range [s, e), the replay boundary r and the mode — "
    "ready (nothing replayed), exact replay (identical to a from-scratch run) or approximate replay "
    "(bounded, measured when verification is on)."
)


DIVERGENCE = {"max |Δlogit|": "max_abs_logit", "mean KL": "mean_kl", "top-1 agreement": "top1_agreement"}


def replay_frame(views) -> pd.DataFrame:
    """One row per scheduled request. The divergence columns appear only once a replay was verified,
    as text, "—" where a request has none (never a literal None)."""
    scheduled = [v for v in views if v.first_scheduled_time is not None]
    rows = [
        {
            "request": v.request_id,
            "mode": v.replay_mode,
            "h": v.cached_tokens,
            "s": v.window_start,
            "e": v.window_end,
            "r": v.replay_from,
            "replayed": v.replayed_tokens,
            "prompt": v.num_prompt_tokens,
            "computed": v.computed_tokens,
        }
        for v in scheduled
    ]
    frame = pd.DataFrame(rows)
    if any(v.replay_divergence for v in scheduled):
        for column, name in DIVERGENCE.items():
            frame[column] = [
                "—" if (value := (v.replay_divergence or {}).get(name)) is None else f"{value:.4g}" for v in scheduled
            ]
    return frame


def replay_bars(frame: pd.DataFrame) -> go.Figure:
    """Per request: the hit, the replayed and the computed spans as one bar, and the window-state range
    [s, e) as a thin band just under it, so a replay bar never hides it. The legend sits above the plot."""
    bar = {"width": 0.5, "offset": -0.38}  # the bar's share of its row, from its top edge (y runs down)
    band = {"width": 0.16, "offset": 0.16}
    spans = {
        "hit, reused [0, r)": (0, frame["r"].clip(upper=frame["h"]), bar),  # beside the replay, not under it
        "replayed [r, h)": (frame["r"], frame["h"] - frame["r"], bar),
        "computed suffix": (frame["h"], frame["prompt"] - frame["h"], bar),
        "window state [s, e)": (frame["s"], frame["e"] - frame["s"], band),
    }
    figure = go.Figure()
    for name, colour in SEGMENTS:
        base, length, shape = spans[name]
        figure.add_bar(
            y=frame["request"], x=length, base=base, orientation="h", name=name, marker_color=colour, opacity=0.9,
            **shape,
        )
    figure.update_layout(
        barmode="overlay",
        height=140 + 34 * len(frame),
        xaxis_title="token position",
        yaxis={"autorange": "reversed", "type": "category"},
        margin={"l": 10, "r": 10, "t": 50, "b": 40},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    )
    return figure


@st.fragment(run_every=REFRESH_S)
def replay_panel() -> None:
    engine = host.console.engine
    stats = engine.stats()
    sliding = [g for g in stats.groups if g.window is not None]
    if not sliding:
        st.info(
            "This model has only full-attention layers: every hit is ready. Restart the engine from Settings with "
            "an attention override (hybrid:W or sliding:W) to try sliding-window layers."
        )
    else:
        group = sliding[0]
        c = st.columns(4)
        c[0].metric("Window W", group.window)
        c[1].metric("Sliding blocks held", f"{group.used_blocks:,}")
        c[2].metric("Released outside the window", f"{group.window_released_blocks:,}",
                    help="Sliding-layer blocks a running request gave back because no future token can see them")
        c[3].metric("Sliding blocks cached", f"{group.cached_blocks:,}")
    if sliding:
        config = host.console.config
        views = [v for v in engine.requests() if v.first_scheduled_time is not None][-MAX_ROWS:]
        sentences = [replay_sentence(v, sliding[0].window, config.block_size, config.window_backtrack) for v in views]
        for sentence in [t for t in sentences if t][-5:]:  # the newest five: why each hit saved what it saved
            st.markdown(sentence)
    frame = replay_frame(engine.requests())
    if frame.empty:
        st.write("No request has been scheduled yet.")
        return
    frame = frame.tail(MAX_ROWS)
    st.plotly_chart(replay_bars(frame), width="stretch", key="replay_bars")
    st.dataframe(frame, hide_index=True, width="stretch")


replay_panel()
