"""The Blocks page's life chart: one block's reference count over engine steps, blocks stacked on one
step axis (storage.read.block_history's frames). Beside app/charts.py, whose figures are one frame or
view each; this one lines several blocks' events up by engine step.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

EVENT_COLOURS = {  # the events of a block's history (storage.read.block_history), by kind
    "allocate": "#2563eb",
    "hit": "#0891b2",
    "fork": "#7c3aed",
    "cow": "#ea580c",
    "release": "#16a34a",
    "window_release": "#16a34a",
    "cache": "#60a5fa",
    "evict": "#6b7280",
    "promote": "#d97706",  # a life that began with the disk tier's copy read into the block
    "demote": "#92400e",  # a life that ended with the block's K/V stored on disk (or copied there, still cached)
    "tier_drop": "#9ca3af",  # evicted, and the disk tier did not take it
}
TIMELINE_ROW_PX = 170  # height of one block's row in stacked timelines
MARKER_ROOM_SHARE = 0.3  # of a timeline's step axis, kept right of the last event for its marker's words
MAX_STEP_TICKS = 16  # labelled steps on a timeline's axis at most


def step_tick(span: float) -> int:
    """The step between labelled steps: 1, 2, 5, 10, 20, ... so at most MAX_STEP_TICKS are labelled."""
    tick = 1
    while span / tick > MAX_STEP_TICKS:
        tick = tick * 5 // 2 if str(tick)[0] == "2" else tick * 2
    return tick


def event_positions(frames: Sequence[pd.DataFrame]) -> dict[int, float]:
    """An x position per stored event id: its engine step, spread within the step in event order.

    Events of one step (two forks, then two copies) keep their order, and an event sits at the same x
    in every block's row it appears in, so stacked rows line up.
    """
    pairs = sorted({(int(s), int(e)) for f in frames for s, e in zip(f["step"], f["event_id"])}, key=lambda p: p[1])
    by_step: dict[int, list[int]] = {}
    for step, event_id in pairs:
        by_step.setdefault(step, []).append(event_id)
    return {
        event_id: step + (i + 1) / (len(ids) + 1) - 0.5
        for step, ids in by_step.items()
        for i, event_id in enumerate(ids)
    }


def block_timelines(blocks: Sequence[tuple[str, pd.DataFrame]], height_px: int = TIMELINE_ROW_PX) -> go.Figure:
    """Reference count over engine steps, one row per block, stacked on one step axis.

    Args:
        blocks: (row title, history frame with storage.read.block_history.HISTORY_COLUMNS) per block, top first.
        height_px: height of one row.

    Each row is a step line of the count with a marker per change (coloured by event, hover: what
    happened and who holds the block after it) and, at the last point where the count reached zero, the
    marker's words: "no holder left: safe to reuse" or, for a cached block, "evictable from here on" (a
    block hit eleven times reaches 0 eleven times; one label says so, not eleven drawn over each other).
    """
    from plotly.subplots import make_subplots

    n = max(1, len(blocks))
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=min(0.08, 0.5 / n),
                        subplot_titles=[title for title, _ in blocks] or [""])  # fmt: skip
    x_of = event_positions([frame for _, frame in blocks])
    shown_kinds: set[str] = set()
    for row, (_, frame) in enumerate(blocks, start=1):
        if frame.empty:
            continue
        x = [x_of[int(e)] for e in frame["event_id"]]
        counts = frame["ref_count"].astype(int).tolist()
        hover = [
            f"step {step} · {event}<br>{change}<br>reference count {count} · holders: {', '.join(holders) or 'none'}"
            + (f"<br><b>{marker}</b>" if marker else "")
            for step, event, change, count, holders, marker in zip(
                frame["step"], frame["event"], frame["change"], counts, frame["holders"], frame["marker"]
            )
        ]
        fig.add_trace(
            go.Scatter(x=[x[0] - 0.4, *x, x[-1] + 0.4], y=[0, *counts, counts[-1]], mode="lines", line={"shape": "hv",
                       "color": "#111827", "width": 2}, hoverinfo="skip", showlegend=False),
            row=row, col=1,
        )  # fmt: skip
        for kind, colour in EVENT_COLOURS.items():
            picked = [i for i, event in enumerate(frame["event"]) if event == kind]
            if not picked:
                continue
            fig.add_trace(
                go.Scatter(
                    x=[x[i] for i in picked], y=[counts[i] for i in picked], mode="markers",
                    marker={"size": 10, "color": colour, "line": {"width": 1, "color": "white"}},
                    name=kind, legendgroup=kind, showlegend=kind not in shown_kinds,
                    hovertext=[hover[i] for i in picked], hoverinfo="text",
                ),
                row=row, col=1,
            )  # fmt: skip
            shown_kinds.add(kind)
        top = max(counts)
        zeros = [i for i, marker in enumerate(frame["marker"]) if marker]
        if zeros:
            # One label a row, at the last time the count reached 0 (what holds from there on); earlier
            # zeros keep their words in their point's hover. Right of the point, where the line only runs
            # on at 0: it hides no earlier change.
            last = zeros[-1]
            marker = frame["marker"].iloc[last]
            again = f"<br>(the count reached 0 {len(zeros)} times)" if len(zeros) > 1 else ""
            fig.add_annotation(x=x[last], y=0, text=f"<b>{marker}</b>{again}", showarrow=True, arrowhead=2, ax=14,
                               ay=-22, xanchor="left", align="left",
                               font={"size": 12, "color": "#15803d" if "safe" in marker else "#1d4ed8"},
                               bgcolor="rgba(255,255,255,0.85)", row=row, col=1)  # fmt: skip
        fig.update_yaxes(range=[-0.3, top + 1.2], dtick=1, title_text="refs", row=row, col=1)
    fig.update_xaxes(title_text="engine step", row=n, col=1)
    if x_of:
        first, last = min(x_of.values()), max(x_of.values())
        span = last - first + 1
        # Room right of the last event for a marker's words (about 30 characters): a share of the axis, not a
        # fixed number of steps, so a long life does not squeeze them off the figure's edge.
        fig.update_xaxes(range=[first - 0.5, last + max(0.9, MARKER_ROOM_SHARE / (1 - MARKER_ROOM_SHARE) * span)],
                         dtick=step_tick(span))  # fmt: skip
    fig.update_layout(
        height=90 + height_px * n,
        margin={"l": 10, "r": 10, "t": 40, "b": 40},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0 + 30 / (90 + height_px * n), "x": 0},
        plot_bgcolor="white",
        hovermode="closest",
    )
    fig.update_xaxes(showgrid=True, gridcolor="#f3f4f6")
    fig.update_yaxes(showgrid=True, gridcolor="#f3f4f6")
    return fig
