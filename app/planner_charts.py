"""The Capacity planner's figures: hit ratio against cache size, and against pool size with a disk tier
behind it, on a log axis (plotly, no Streamlit)."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

POLICY_COLOURS = {"lru": "#2563eb", "reuse-lru": "#16a34a", "fifo": "#9ca3af", "lfu": "#a855f7", "opt": "#dc2626"}
POLICY_LABELS = {"opt": "opt (the offline optimum)"}
ENGINE_COLOUR = "#f59e0b"
TIER_COLOUR = "#0d9488"  # the disk tier's curves
TICK_STEPS = (1, 2, 5)  # log-axis ticks at 1, 2 and 5 times each power of ten


def token_label(tokens: float) -> str:
    """A tick's text: 500, 2k, 50k, 1M, 2G (no more than three characters of digits)."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens >= size:
            return f"{tokens / size:g}{suffix}"
    return f"{tokens:g}"


def log_ticks(low: float, high: float) -> list[float]:
    """1, 2, 5 × each power of ten from `low` to `high` (both above 0)."""
    ticks = []
    for power in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1):
        ticks += [step * 10.0**power for step in TICK_STEPS if low <= step * 10.0**power <= high]
    return ticks


def hit_ratio_curves(lru: pd.DataFrame, points: pd.DataFrame, max_hit_ratio: float, engine_tokens: int) -> go.Figure:
    """LRU's dense curve, every policy's evaluated points, the ceiling no cache goes above (the maximum
    hit ratio: an infinite cache) and a labelled marker at the running engine's pool size.

    Args:
        lru: capacity_tokens, hit_ratio (the one-pass LRU curve).
        points: policy, capacity_tokens, hit_ratio (`app.planner.curve_frame`).
        max_hit_ratio: the infinite cache's hit ratio.
        engine_tokens: the running engine's pool, in tokens.
    """
    figure = go.Figure()
    figure.add_trace(
        go.Scatter(x=lru["capacity_tokens"], y=lru["hit_ratio"], mode="lines", name="lru (every capacity)",
                   line={"color": POLICY_COLOURS["lru"], "width": 2})
    )  # fmt: skip
    for policy, rows in points.groupby("policy", sort=False):
        figure.add_trace(
            go.Scatter(
                x=rows["capacity_tokens"],
                y=rows["hit_ratio"],
                mode="markers" if policy == "lru" else "lines+markers",
                name=POLICY_LABELS.get(policy, policy),
                line={"color": POLICY_COLOURS.get(policy), "dash": "dot" if policy == "opt" else "solid"},
                marker={"size": 7},
            )
        )
    figure.add_hline(y=max_hit_ratio, line={"dash": "dash", "color": "#111827"},
                     annotation_text=f"maximum: hit ratio {max_hit_ratio:.1%} (infinite cache)",
                     annotation_position="top left")  # fmt: skip
    figure.add_trace(  # the pool marker as a legend entry too: the orange line says what it is
        go.Scatter(x=[engine_tokens, engine_tokens], y=[0, 1], mode="lines", name=f"this engine's pool ({engine_tokens:,} tokens)",
                   line={"dash": "dot", "color": ENGINE_COLOUR, "width": 2}, hoverinfo="name")
    )  # fmt: skip
    figure.add_annotation(x=math.log10(engine_tokens), y=1.0, yanchor="bottom", showarrow=False,
                          text=f"this engine's pool: {engine_tokens:,} tokens", font={"color": "#b45309"})  # fmt: skip
    xs = [*lru["capacity_tokens"], *points["capacity_tokens"], engine_tokens]
    low, high = max(min(xs), 1), max(max(xs), 1)
    return _hit_ratio_axes(figure, low, high, "cache capacity (tokens)", height=460)


def tier_curves(tiers: pd.DataFrame, tier_gib: float, max_hit_ratio: float, engine_tokens: int) -> go.Figure:
    """Hit ratio by pool size, alone and with a disk tier of `tier_gib` behind it, with this engine's floor.

    Args:
        tiers: capacity_tokens, pool_alone, with_tier, floor (`app.planner.tier_frame`).
        tier_gib: the tier's size (for the legend).
        max_hit_ratio: the infinite cache's hit ratio.
        engine_tokens: the running engine's pool, in tokens.
    """
    figure = go.Figure()
    lines = (
        ("pool_alone", "pool alone (lru)", {"color": POLICY_COLOURS["lru"], "width": 2}),
        ("with_tier", f"pool + {tier_gib:g} GiB disk tier", {"color": TIER_COLOUR, "width": 2}),
        ("floor", "this engine's tier at least (it keeps what it promotes)", {"color": TIER_COLOUR, "dash": "dot"}),
    )
    for column, name, line in lines:
        figure.add_trace(go.Scatter(x=tiers["capacity_tokens"], y=tiers[column], mode="lines", name=name, line=line))
    figure.add_hline(y=max_hit_ratio, line={"dash": "dash", "color": "#111827"},
                     annotation_text=f"maximum: hit ratio {max_hit_ratio:.1%} (infinite cache)",
                     annotation_position="top left")  # fmt: skip
    figure.add_vline(x=engine_tokens, line={"dash": "dot", "color": ENGINE_COLOUR, "width": 2})
    low, high = max(min(tiers["capacity_tokens"].min(), engine_tokens), 1), max(tiers["capacity_tokens"].max(), engine_tokens, 1)
    return _hit_ratio_axes(figure, low, high, "pool capacity (tokens)", height=420)


def _hit_ratio_axes(figure: go.Figure, low: float, high: float, x_title: str, *, height: int) -> go.Figure:
    """A hit-ratio-by-capacity figure's axes: capacity on a log axis with token ticks over [low, high], the
    hit ratio from 0 to 105 %, the legend below."""
    ticks = log_ticks(low, high)
    figure.update_layout(
        xaxis={"type": "log", "title": x_title, "tickvals": ticks, "ticktext": [token_label(t) for t in ticks]},
        yaxis={"title": "hit ratio (tokens)", "range": [0, 1.05], "tickformat": ".0%"},
        legend={"orientation": "h", "y": -0.2},
        margin={"l": 10, "r": 10, "t": 30, "b": 10},
        height=height,
    )  # fmt: skip
    return figure
