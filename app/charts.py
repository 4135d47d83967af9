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

from app.frames import CACHED, FREE, TableAlignment, block_category, category_order, holders_text
from engine.core.snapshot import BlockView

GRID_WIDTH_PX = 900  # the width the grid's cell size is computed for
WEBGL_ABOVE = 2048  # pools larger than this render with scattergl
TEXT_UP_TO = 512  # pools up to this size print the reference count in each referenced cell
PROMOTED_NAME = "promoted from disk"  # the grid's trace of blocks the disk tier filled
PROMOTED_COLOUR = "#7c3aed"
PROMOTED_MARK_PX = 8
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


def block_grid(
    blocks: Sequence[BlockView],
    block_size: int,
    selected: int | None = None,
    highlight: Sequence[int] = (),
    statuses: dict[str, str] | None = None,
    promoted: Sequence[int] = (),
) -> go.Figure:
    """Every physical block as one square cell, coloured by state; block id = row * columns + column.

    Args:
        blocks: every block of one group, in block-id order.
        block_size: token slots per block (for the hover).
        selected: the block the inspector shows (outlined black).
        highlight: blocks to outline in blue (a request's, picked on the page).
        statuses: request statuses by id, so the hover names each holder with its status.
        promoted: blocks whose K/V were read from the disk tier in their current life (a purple corner mark).

    The figure has a fixed pixel size (cells stay square); draw it with `width="content"`. The legend
    is left to the page (`category_order` and `COLOURS`), so narrow grids stay readable.
    """
    n = len(blocks)
    cols = grid_columns(n)
    rows = max(1, math.ceil(n / cols))
    cell = grid_cell_px(n)
    scatter = go.Scattergl if n > WEBGL_ABOVE else go.Scatter
    names = category_order()
    statuses = statuses or {}
    category = np.fromiter((names.index(block_category(b)) for b in blocks), dtype=np.int64, count=n)
    # Numpy columns, not lists: plotly validates arrays at once, which keeps 16k-block grids fast.
    data = np.array([(b.block_id, b.num_tokens, b.start_pos, b.hit_count, len(b.holders), b.ref_count) for b in blocks], dtype=np.int64).reshape(n, 6)
    fig = go.Figure()
    for index, name in enumerate(names):
        members = np.flatnonzero(category == index)
        if not len(members):
            continue
        rows_of = data[members]
        ids = rows_of[:, 0]
        show_text = n <= TEXT_UP_TO and cell >= 14 and name not in (FREE, CACHED)
        if name == FREE:
            hover = [f"block {b} · free: holds nothing" for b in ids]
        else:
            hover = [
                f"block {b.block_id} · {name}<br>{b.num_tokens}/{block_size} tokens from position {b.start_pos} · "
                f"prefix hits {b.hit_count}<br>holders: {holders_text(b.holders, statuses)}"
                for b in (blocks[i] for i in members)
            ]
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
                hovertext=hover,
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
    marked = [b for b in highlight if 0 <= b < n]
    if marked:
        fig.add_trace(
            go.Scatter(
                x=[b % cols for b in marked],
                y=[b // cols for b in marked],
                mode="markers",
                marker={"symbol": "square-open", "size": cell, "color": "#2563eb", "line": {"width": 3}},
                name="highlighted",
                hoverinfo="skip",
            )
        )
    from_disk = [b for b in promoted if 0 <= b < n]
    if from_disk:
        size = max(4, min(PROMOTED_MARK_PX, cell - 2))
        corner = 0.5 - 0.5 * size / cell  # the mark sits in the cell's top-right corner
        fig.add_trace(
            go.Scatter(
                x=[b % cols + corner for b in from_disk],
                y=[b // cols - corner for b in from_disk],
                mode="markers",
                marker={"symbol": "triangle-ne", "size": size, "color": PROMOTED_COLOUR, "line": {"width": 0}},
                name=PROMOTED_NAME,
                hovertext=[f"block {b} · promoted from the disk tier" for b in from_disk],
                hovertemplate="%{hovertext}<extra></extra>",
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
    """Block tables as rows; a cell is a physical block id, darker when more of the holding rows share it.

    A row whose request no longer holds blocks (finished or released) is grey: it still shows the table
    it ended with, and shares nothing.
    """
    top = max(2, sum(alignment.holding))
    z = [
        [None if cell is None else count for cell, count in zip(row, shared)]
        for row, shared in zip(alignment.block_ids, alignment.shared)
    ]
    text = [["" if cell is None else str(cell) for cell in row] for row in alignment.block_ids]
    labels = [rid if held else f"{rid} (holds nothing now)" for rid, held in zip(alignment.request_ids, alignment.holding)]
    hover = [
        [
            f"{rid} · logical block {i} → physical block {cell}<br>"
            + (f"held by {count} of the rows shown" if held else "no longer held by this request")
            for i, (cell, count) in enumerate(zip(row, shared))
        ]
        for rid, row, shared, held in zip(alignment.request_ids, alignment.block_ids, alignment.shared, alignment.holding)
    ]
    grey_until = 0.5 / top  # z = 0 (a row that holds nothing) is grey; 1 .. top run yellow to red
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            texttemplate="%{text}",
            customdata=hover,
            x=list(range(len(alignment.block_ids[0]) if alignment.block_ids else 0)),
            y=labels,
            colorscale=[[0.0, "#e5e7eb"], [grey_until, "#e5e7eb"], [grey_until + 1e-6, "#fde68a"], [1.0, "#b91c1c"]],
            zmin=0,
            zmax=top,
            xgap=2,
            ygap=2,
            colorbar={"title": "rows holding", "tickvals": list(range(1, top + 1))},
            hovertemplate="%{customdata}<extra></extra>",
        )
    )
    fig.update_xaxes(title="logical block index", dtick=1, side="top")
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_layout(height=max(160, 60 + 36 * len(alignment.request_ids)), margin={"l": 4, "r": 4, "t": 40, "b": 4})
    return fig


ICICLE_MIN_TEXT_PX = 10  # a tile label that would be drawn smaller is left out (its hover still has it)


def prefix_icicle(
    ids: list[str], parents: list[str], labels: list[str], values: list[int], colour: list[int], hover: list[str],
    colour_title: str = "hits", *, height_px: int = 560, max_levels: int = -1,
) -> go.Figure:
    """The prefix index as an icicle: height is tokens under a tile, colour a count (prefix hits, or holders).

    The colour scale starts at 0 and ends at the largest count, at least 1, so a cache whose counts are
    all 0 is drawn in the lightest colour with a 0-1 scale, not centred on 0. Labels keep 12 px where
    they fit; Plotly shrinks one that does not, down to ICICLE_MIN_TEXT_PX and then leaves it out,
    never drawing it as an unreadable speck. `height_px` is the plot area's; `max_levels` the tile
    columns drawn at once (-1: all).
    """
    top = max(1, max(colour, default=0))
    fig = go.Figure(
        go.Icicle(
            ids=ids,
            parents=parents,
            labels=labels,
            values=values,
            branchvalues="remainder",
            maxdepth=max_levels,
            marker={
                "colors": colour,
                "colorscale": [[0.0, "#eff6ff"], [1.0, "#1e3a8a"]],
                "cmin": 0,
                "cmax": top,
                "showscale": True,
                "colorbar": {"title": colour_title, "tick0": 0, "dtick": max(1, math.ceil(top / 5)),
                             "len": min(1.0, 560 / height_px), "y": 1, "yanchor": "top"},  # near the top of tall trees
                "line": {"color": "white", "width": 1},
            },
            hovertext=hover,
            hoverinfo="text",
            tiling={"orientation": "h"},
            textfont={"size": 12},
        )
    )
    margin = {"l": 4, "r": 4, "t": 10, "b": 4}
    fig.update_layout(
        height=height_px + margin["t"] + margin["b"],
        margin=margin,
        uniformtext={"minsize": ICICLE_MIN_TEXT_PX, "mode": "hide"},
    )
    return fig


TOOLBAR_PX = 32  # the top strip Plotly's toolbar takes while the pointer is over a chart
TITLE_PAD_PX = 6  # between a chart's title and its plot area


def titled(fig: go.Figure, title: str, height: int, bottom: int = 4) -> go.Figure:
    """Give `fig` its title in a row of its own, below the strip the toolbar shows in and above the plot
    area, left-aligned: the toolbar (top right) never covers a long title in a half-width column."""
    fig.update_layout(
        title={"text": title, "x": 0, "xref": "paper", "xanchor": "left", "y": 1, "yref": "paper", "yanchor": "bottom",
               "pad": {"b": TITLE_PAD_PX}, "font": {"size": 15}},
        height=height,
        margin={"l": 4, "r": 4, "t": TOOLBAR_PX + 20 + TITLE_PAD_PX + 4, "b": bottom},
    )  # fmt: skip
    return fig


def history_lines(frame: pd.DataFrame, columns: list[str], title: str, percent: bool = False) -> go.Figure:
    fig = go.Figure()
    for column in columns:
        fig.add_trace(go.Scatter(x=frame["time"], y=frame[column], mode="lines", name=column, line={"shape": "hv"}))
    titled(fig, title, height=320, bottom=56)
    fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.3, "x": 0})
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
    titled(fig, title, height=300).update_layout(barmode="stack")
    return fig


def histogram_bars(frame: pd.DataFrame, title: str, unit: str) -> go.Figure:
    """Bars of a storage histogram frame (bin_start, bin_end, evictions), one bar per bin."""
    labels = [_bin_label(start, end, unit) for start, end in zip(frame["bin_start"], frame["bin_end"])]
    fig = go.Figure(go.Bar(x=labels, y=frame["evictions"], marker_color="#60a5fa"))
    titled(fig, title, height=300)
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
    titled(fig, title, height=280)
    return fig
