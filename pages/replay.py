"""Replay: for every request, how much of its prefix hit, which window state was there, what was replayed."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from app.hosting import get_host
from app.ui import REFRESH_S

SEGMENTS = (  # (name, colour): drawn in this order, later segments on top
    ("hit [0, h)", "#93c5fd"),
    ("window state [s, e)", "#22c55e"),
    ("replayed [r, h)", "#f97316"),
    ("computed suffix", "#a855f7"),
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


def replay_frame(views) -> pd.DataFrame:
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
            "max |Δlogit|": (v.replay_divergence or {}).get("max_abs_logit"),
            "mean KL": (v.replay_divergence or {}).get("mean_kl"),
            "top-1 agreement": (v.replay_divergence or {}).get("top1_agreement"),
        }
        for v in views
        if v.first_scheduled_time is not None
    ]
    return pd.DataFrame(rows)


def replay_bars(frame: pd.DataFrame) -> go.Figure:
    spans = {
        "hit [0, h)": (0, frame["h"]),
        "window state [s, e)": (frame["s"], frame["e"] - frame["s"]),
        "replayed [r, h)": (frame["r"], frame["h"] - frame["r"]),
        "computed suffix": (frame["h"], frame["prompt"] - frame["h"]),
    }
    figure = go.Figure()
    for name, colour in SEGMENTS:
        base, length = spans[name]
        figure.add_bar(
            y=frame["request"], x=length, base=base, orientation="h", name=name, marker_color=colour, opacity=0.85
        )
    figure.update_layout(
        barmode="overlay",
        height=120 + 28 * len(frame),
        xaxis_title="token position",
        yaxis={"autorange": "reversed"},
        margin={"l": 10, "r": 10, "t": 30, "b": 10},
        legend={"orientation": "h"},
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
    frame = replay_frame(engine.requests())
    if frame.empty:
        st.write("No request has been scheduled yet.")
        return
    frame = frame.tail(MAX_ROWS)
    st.plotly_chart(replay_bars(frame), use_container_width=True, key="replay_bars")
    st.dataframe(frame, hide_index=True, use_container_width=True)


replay_panel()
