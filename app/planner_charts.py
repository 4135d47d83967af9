"""The Capacity planner's figure: miss ratio against cache size, on a log axis (plotly, no Streamlit)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

POLICY_COLOURS = {"lru": "#2563eb", "reuse-lru": "#16a34a", "fifo": "#9ca3af", "lfu": "#a855f7", "opt": "#dc2626"}
POLICY_LABELS = {"opt": "opt (the offline optimum)"}


def miss_ratio_curves(lru: pd.DataFrame, points: pd.DataFrame, max_hit_ratio: float, engine_tokens: int) -> go.Figure:
    """LRU's dense curve, every policy's evaluated points, the floor no cache goes below (1 - the maximum
    hit ratio) and a marker at the running engine's pool size.

    Args:
        lru: capacity_tokens, miss_ratio (the one-pass LRU curve).
        points: policy, capacity_tokens, miss_ratio (`app.planner.curve_frame`).
        max_hit_ratio: the infinite cache's hit ratio.
        engine_tokens: the running engine's pool, in tokens.
    """
    figure = go.Figure()
    figure.add_trace(
        go.Scatter(x=lru["capacity_tokens"], y=lru["miss_ratio"], mode="lines", name="lru (every capacity)",
                   line={"color": POLICY_COLOURS["lru"], "width": 2})
    )  # fmt: skip
    for policy, rows in points.groupby("policy", sort=False):
        figure.add_trace(
            go.Scatter(
                x=rows["capacity_tokens"],
                y=rows["miss_ratio"],
                mode="markers" if policy == "lru" else "lines+markers",
                name=POLICY_LABELS.get(policy, policy),
                line={"color": POLICY_COLOURS.get(policy), "dash": "dot" if policy == "opt" else "solid"},
                marker={"size": 7},
            )
        )
    floor = 1.0 - max_hit_ratio
    figure.add_hline(y=floor, line={"dash": "dash", "color": "#111827"},
                     annotation_text=f"maximum: miss ratio {floor:.3f} (infinite cache)", annotation_position="top left")  # fmt: skip
    figure.add_vline(x=engine_tokens, line={"dash": "dot", "color": "#f59e0b"},
                     annotation_text=f"this engine: {engine_tokens:,} tokens", annotation_position="top right")  # fmt: skip
    figure.update_layout(
        xaxis={"type": "log", "title": "cache capacity (tokens)"},
        yaxis={"title": "miss ratio (tokens)", "range": [0, 1.02]},
        legend={"orientation": "h", "y": -0.2},
        margin={"l": 10, "r": 10, "t": 30, "b": 10},
        height=460,
    )
    return figure
