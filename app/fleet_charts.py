"""Plotly figures of the Fleet pages (the cache pages' figures are app/charts.py)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from app.charts import _bin_label, prefix_icicle


def block_rate_lines(rates: pd.DataFrame, bucket_seconds: float) -> go.Figure:
    """Blocks stored and removed per second, one line per (pod, kind); `rates` is
    storage.read.fleet_queries.block_rates with a pod column."""
    fig = go.Figure()
    for (pod, kind), part in rates.groupby(["pod", "kind"], sort=True):
        fig.add_trace(
            go.Scatter(
                x=pd.to_datetime(part["bucket_start"], unit="s", utc=True),
                y=part["blocks"] / bucket_seconds,
                mode="lines+markers",
                name=f"{pod} {kind}",
                line={"dash": "solid" if kind == "stored" else "dot", "shape": "hv"},
            )
        )
    fig.update_yaxes(title="blocks/s", rangemode="tozero")
    # A bucket either side: with a single bucket plotly would zoom the time axis to a millisecond.
    starts = rates["bucket_start"]
    span = pd.to_datetime([starts.min() - bucket_seconds, starts.max() + bucket_seconds], unit="s", utc=True)
    fig.update_xaxes(range=list(span))
    fig.update_layout(
        title="Blocks stored and removed",
        height=300,
        margin={"l": 4, "r": 4, "t": 40, "b": 56},
        legend={"orientation": "h", "yanchor": "top", "y": -0.25, "x": 0},
    )
    return fig


TREE_COLOURS = {  # what colours a node of the fleet prefix tree: column of app.fleet_view.tree_frame -> title
    "replicas": "pods",
    "copies": "copies",
    "age_s": "age (s)",
    "idle_s": "idle (s)",
    "tokens_below": "tokens below",
}


def fleet_icicle(frame: pd.DataFrame, hover: list[str], labels: list[str], colour_by: str = "replicas") -> go.Figure:
    """The cross-pod prefix tree: width is tokens under a node, colour the column `colour_by` (TREE_COLOURS)."""
    ids = [f"n{node}" for node in frame["node_id"]]
    parents = ["" if pd.isna(parent) else f"n{int(parent)}" for parent in frame["parent_id"]]
    values = [len(tokens) for tokens in frame["token_ids"]]
    colour = [round(value) for value in frame[colour_by]]
    return prefix_icicle(ids, parents, labels, values, colour, hover, colour_title=TREE_COLOURS[colour_by])


def binned_bars(frame: pd.DataFrame, count: str, title: str, colour: str | None = None) -> go.Figure:
    """Bars of seconds bins (bin_start, bin_end, `count`), stacked by `colour` when given."""
    fig = go.Figure()
    parts = frame.groupby(colour, sort=True) if colour else [(None, frame)]
    for name, part in parts:
        labels = [_bin_label(start, end, "s") for start, end in zip(part["bin_start"], part["bin_end"])]
        fig.add_trace(go.Bar(x=labels, y=part[count], name=str(name) if name is not None else count))
    fig.update_layout(
        barmode="stack", title=title, height=280, margin={"l": 4, "r": 4, "t": 40, "b": 4}, showlegend=bool(colour)
    )
    fig.update_xaxes(type="category")
    return fig


def pod_metrics_lines(frame: pd.DataFrame, pod: str) -> go.Figure:
    """A pod's /metrics over time (app.fleet_view.metrics_frame): KV usage and hit rate (left axis,
    fractions), preemptions per scrape, running and waiting requests (right axis, counts)."""
    fig = go.Figure()
    for column, name in (("kv_usage", "KV usage"), ("hit_rate", "hit rate")):
        fig.add_trace(go.Scatter(x=frame["at"], y=frame[column], mode="lines", name=name))
    for column, name in (("running", "running"), ("waiting", "waiting"), ("preemptions", "preemptions")):
        fig.add_trace(
            go.Scatter(x=frame["at"], y=frame[column], mode="lines", name=name, yaxis="y2", line={"dash": "dot"})
        )
    fig.update_layout(
        title=f"{pod}: KV usage, hit rate, requests",
        height=300,
        margin={"l": 4, "r": 4, "t": 40, "b": 56},
        yaxis={"title": "fraction", "range": [0, 1], "tickformat": ".0%"},
        yaxis2={"title": "requests", "overlaying": "y", "side": "right", "rangemode": "tozero"},
        legend={"orientation": "h", "yanchor": "top", "y": -0.25, "x": 0},
    )
    return fig
