"""Plotly figures for the console pages: plain functions from frames and views to figures.

The block grid is one scatter trace per colour class (scattergl for large pools), never one widget per
block, so a 16k-block pool is a single chart. Nothing here varies with wall-clock time, so a figure
only changes when the engine state does (a chart that does not change keeps its selection).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.frames import CACHED, FREE, TableAlignment, block_category, category_order
from engine.snapshot import BlockView

GRID_WIDTH_PX = 900  # the width the grid's cell size is computed for
WEBGL_ABOVE = 2048  # pools larger than this render with scattergl
TEXT_UP_TO = 512  # pools up to this size print the reference count in each referenced cell
COLOURS = {
    FREE: "#e5e7eb",
    CACHED: "#60a5fa",
    "referenced ×1": "#fbbf24",
    "referenced ×2": "#f97316",
    "referenced ×3": "#dc2626",
    "referenced ×4+": "#7f1d1d",
}


def grid_columns(num_blocks: int) -> int:
    """Columns of the block grid: about twice as wide as tall, between 8 and 128."""
    return max(1, min(num_blocks, 128, max(8, math.ceil(math.sqrt(num_blocks * 2)))))


def block_at(x: float, y: float, columns: int) -> int:
    """The block id of a grid cell."""
    return int(round(y)) * columns + int(round(x))


def grid_cell_px(num_blocks: int) -> int:
    """Side of one grid cell in pixels: large for small pools, at least 4 px at 128 columns."""
    return max(4, min(28, GRID_WIDTH_PX // grid_columns(num_blocks)))


def block_grid(blocks: Sequence[BlockView], block_size: int, selected: int | None = None) -> go.Figure:
    """Every physical block as one square cell, coloured by state; block id = row * columns + column.

    The figure has a fixed pixel size (cells stay square); draw it with `width="content"`. The legend
    is left to the page (`category_order` and `COLOURS`), so narrow grids stay readable.
    """
    n = len(blocks)
    cols = grid_columns(n)
    rows = max(1, math.ceil(n / cols))
    cell = grid_cell_px(n)
    scatter = go.Scattergl if n > WEBGL_ABOVE else go.Scatter
    names = category_order()
    category = np.fromiter((names.index(block_category(b)) for b in blocks), dtype=np.int64, count=n)
    # Numpy columns, not lists: plotly validates arrays at once, which keeps 16k-block grids fast.
    data = np.array([(b.block_id, b.num_tokens, b.start_pos, b.hit_count, len(b.holders), b.ref_count) for b in blocks], dtype=np.int64).reshape(n, 6)
    fig = go.Figure()
    for index, name in enumerate(names):
        rows_of = data[category == index]
        if not len(rows_of):
            continue
        ids = rows_of[:, 0]
        show_text = n <= TEXT_UP_TO and cell >= 14 and name not in (FREE, CACHED)
        fig.add_trace(
            scatter(
                x=ids % cols,
                y=ids // cols,
                mode="markers+text" if show_text else "markers",
                text=rows_of[:, 5].astype(str) if show_text else None,
                textfont={"size": max(8, cell // 2), "color": "white"},
                customdata=rows_of[:, :5],
                marker={"symbol": "square", "size": cell - 2, "color": COLOURS[name], "line": {"width": 0}},
                selected={"marker": {"opacity": 1}},
                unselected={"marker": {"opacity": 1}},  # a click selects; the other cells must not fade
                name=name,
                hovertemplate=(
                    f"block %{{customdata[0]}} · {name}<br>%{{customdata[1]}}/{block_size} tokens from position "
                    "%{customdata[2]} · hits %{customdata[3]} · holders %{customdata[4]}<extra></extra>"
                ),
            )
        )
    if selected is not None and 0 <= selected < n:
        fig.add_trace(
            go.Scatter(
                x=[selected % cols],
                y=[selected // cols],
                mode="markers",
                marker={"symbol": "square-open", "size": cell + 2, "color": "#111827", "line": {"width": 2}},
                name=f"selected: block {selected}",
                hoverinfo="skip",
            )
        )
    pad = 6
    fig.update_xaxes(visible=False, range=[-0.5, cols - 0.5], fixedrange=True)
    fig.update_yaxes(visible=False, range=[rows - 0.5, -0.5], fixedrange=True)
    fig.update_layout(
        width=cols * cell + 2 * pad,
        height=rows * cell + 2 * pad,
        margin={"l": pad, "r": pad, "t": pad, "b": pad},
        showlegend=False,
        clickmode="event+select",
        dragmode=False,
        plot_bgcolor="white",
    )
    return fig


def legend_markdown(counts: pd.DataFrame) -> str:
    """The grid's legend with counts: a coloured square per state (markdown with inline HTML)."""
    return " &nbsp; ".join(
        f'<span style="color:{COLOURS[row.state]}">■</span> **{row.state}**: {row.blocks:,}' for row in counts.itertuples()
    )


def table_alignment(alignment: TableAlignment) -> go.Figure:
    """Block tables as rows; a cell is a physical block id, darker when more of the rows share it."""
    z = [[None if cell is None else count for cell, count in zip(row, shared)] for row, shared in zip(alignment.block_ids, alignment.shared)]
    text = [["" if cell is None else str(cell) for cell in row] for row in alignment.block_ids]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            texttemplate="%{text}",
            x=list(range(len(alignment.block_ids[0]) if alignment.block_ids else 0)),
            y=alignment.request_ids,
            colorscale=[[0.0, "#fde68a"], [1.0, "#b91c1c"]],
            zmin=1,
            zmax=max(2, len(alignment.request_ids)),
            xgap=2,
            ygap=2,
            colorbar={"title": "rows sharing"},
            hovertemplate="%{y} · logical block %{x} → physical block %{text}<br>shared by %{z} of the rows<extra></extra>",
        )
    )
    fig.update_xaxes(title="logical block index", dtick=1, side="top")
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_layout(height=max(160, 60 + 36 * len(alignment.request_ids)), margin={"l": 4, "r": 4, "t": 40, "b": 4})
    return fig


def prefix_icicle(ids: list[str], parents: list[str], labels: list[str], values: list[int], hits: list[int], hover: list[str]) -> go.Figure:
    """The prefix index as an icicle: width is tokens under a node, colour is its hit count."""
    fig = go.Figure(
        go.Icicle(
            ids=ids,
            parents=parents,
            labels=labels,
            values=values,
            branchvalues="remainder",
            marker={"colors": hits, "colorscale": "Blues", "showscale": True, "colorbar": {"title": "hits"}},
            hovertext=hover,
            hoverinfo="text",
            tiling={"orientation": "h"},
            maxdepth=12,
        )
    )
    fig.update_layout(height=560, margin={"l": 4, "r": 4, "t": 10, "b": 4})
    return fig


def history_lines(frame: pd.DataFrame, columns: list[str], title: str, percent: bool = False) -> go.Figure:
    fig = go.Figure()
    for column in columns:
        fig.add_trace(go.Scatter(x=frame["time"], y=frame[column], mode="lines", name=column, line={"shape": "hv"}))
    fig.update_layout(
        title=title,
        height=300,
        margin={"l": 4, "r": 4, "t": 40, "b": 56},
        legend={"orientation": "h", "yanchor": "top", "y": -0.3, "x": 0},
    )
    if percent:
        fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return fig


def stacked_bars(frame: pd.DataFrame, x: str, y: str, colour: str, title: str, bucket_seconds: float) -> go.Figure:
    """Bars per time bucket, stacked by `colour`; each bar spans its bucket (x holds bucket starts)."""
    fig = go.Figure()
    for name, part in frame.groupby(colour, sort=True):
        fig.add_trace(
            go.Bar(
                x=part[x] + pd.Timedelta(seconds=bucket_seconds / 2),
                y=part[y],
                name=str(name),
                width=bucket_seconds * 1000 * 0.9,  # milliseconds on a date axis
            )
        )
    start, end = frame[x].min(), frame[x].max() + pd.Timedelta(seconds=bucket_seconds)
    pad = max(pd.Timedelta(seconds=bucket_seconds), (end - start) * 0.05)
    fig.update_xaxes(range=[start - pad, end + pad])
    fig.update_layout(barmode="stack", title=title, height=280, margin={"l": 4, "r": 4, "t": 40, "b": 4})
    return fig


def histogram_bars(frame: pd.DataFrame, title: str, unit: str) -> go.Figure:
    """Bars of a storage histogram frame (bin_start, bin_end, evictions), one bar per bin."""
    labels = [_bin_label(start, end, unit) for start, end in zip(frame["bin_start"], frame["bin_end"])]
    fig = go.Figure(go.Bar(x=labels, y=frame["evictions"], marker_color="#60a5fa"))
    fig.update_layout(title=title, height=280, margin={"l": 4, "r": 4, "t": 40, "b": 4})
    fig.update_xaxes(type="category")
    return fig


def _bin_label(start: float, end: float, unit: str) -> str:
    """"[start, end)" as text: integer bins (no unit) read "3–4", second bins "10 s–1 min"."""
    if unit == "s":
        return f"≥{_seconds(start)}" if math.isinf(end) else f"{_seconds(start)}–{_seconds(end)}"
    if math.isinf(end):
        return f"≥{start:g}"
    return f"{start:g}" if end - start == 1 else f"{start:g}–{end - 1:g}"


def _seconds(value: float) -> str:
    for size, name in ((86400, "d"), (3600, "h"), (60, "min")):
        if value >= size:
            return f"{value / size:g} {name}"
    return f"{value:g} s"


def rate_bars(frame: pd.DataFrame, x: str, y: str, title: str, bucket_seconds: float) -> go.Figure:
    """A share (0..1) per time bucket as bars spanning their bucket (x holds bucket starts)."""
    fig = go.Figure(
        go.Bar(
            x=frame[x] + pd.Timedelta(seconds=bucket_seconds / 2),
            y=frame[y],
            width=bucket_seconds * 1000 * 0.9,
            marker_color="#60a5fa",
            customdata=frame[["requests"]] if "requests" in frame else None,
            hovertemplate="%{y:.1%}" + (" over %{customdata[0]} requests" if "requests" in frame else "") + "<extra></extra>",
        )
    )
    start, end = frame[x].min(), frame[x].max() + pd.Timedelta(seconds=bucket_seconds)
    pad = max(pd.Timedelta(seconds=bucket_seconds), (end - start) * 0.05)
    fig.update_xaxes(range=[start - pad, end + pad])
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05])
    fig.update_layout(title=title, height=260, margin={"l": 4, "r": 4, "t": 40, "b": 4})
    return fig
