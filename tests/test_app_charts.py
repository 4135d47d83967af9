"""The console's Plotly figures read as figures (no Streamlit, no engine): what a chart draws, where its title sits."""

from __future__ import annotations

import pandas as pd

from app import charts, timeline_charts
from storage.read.block_history import EVICTABLE_FROM_HERE, HISTORY_COLUMNS, SAFE_TO_REUSE


def life(changes: list[tuple[str, int, str]]) -> pd.DataFrame:
    """A block's history frame from (event, reference count after it, marker) rows, one engine step each."""
    rows = [
        {"event_id": i + 1, "step": i, "time": 1_000.0 + i, "event": event, "request_id": f"req-{i}", "change": event,
         "ref_count": count, "holders": [f"req-{i}"] if count else [], "state": "referenced" if count else "evictable",
         "marker": marker, "life": 0}
        for i, (event, count, marker) in enumerate(changes)
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=list(HISTORY_COLUMNS))


def marker_labels(figure) -> list[str]:
    return [a.text for a in figure.layout.annotations if SAFE_TO_REUSE in a.text or EVICTABLE_FROM_HERE in a.text]


def test_a_block_hit_eleven_times_gets_one_evictable_label_that_counts_them():
    """Regression (issue 47, item 14b): each of the eleven times the count fell back to 0 drew its own
    "evictable from here on", eleven labels over each other."""
    changes = [("allocate", 1, ""), ("release", 0, EVICTABLE_FROM_HERE)]
    for _ in range(11):
        changes += [("hit", 1, ""), ("release", 0, EVICTABLE_FROM_HERE)]
    figure = timeline_charts.block_timelines([("block 3", life(changes))])
    labels = marker_labels(figure)
    assert len(labels) == 1 and "reached 0 12 times" in labels[0]
    points = [x for trace in figure.data[1:] for x in trace.x]  # the event markers (data[0] is the step line)
    assert figure.layout.annotations[-1].x == max(points)  # at the last time it reached 0
    hovers = [text for trace in figure.data if trace.hovertext for text in trace.hovertext]
    assert sum(EVICTABLE_FROM_HERE in text for text in hovers) == 12  # every earlier one still says it on hover


def test_a_block_that_reached_0_once_keeps_its_plain_label():
    figure = timeline_charts.block_timelines([("block 1", life([("allocate", 1, ""), ("release", 0, SAFE_TO_REUSE)]))])
    assert marker_labels(figure) == [f"<b>{SAFE_TO_REUSE}</b>"]


def test_chart_titles_sit_below_the_toolbars_strip():
    """Regression (issue 47, item 15): titles sat in the top margin's row, where Plotly's toolbar shows on
    hover (top right), so a long title in a half-width column ran under it."""
    times = pd.to_datetime([0, 60], unit="s", utc=True)
    figures = [
        charts.history_lines(pd.DataFrame({"time": times, "a": [1, 2]}), ["a"], "Evictions, window drops, copies, preemptions (totals)"),
        charts.stacked_bars(pd.DataFrame({"t": times, "n": [1, 2], "kind": ["x", "y"]}), "t", "n", "kind", "Evictions", 60.0),
        charts.histogram_bars(pd.DataFrame({"bin_start": [0.0], "bin_end": [1.0], "evictions": [3]}), "Age at eviction", "s"),
        charts.rate_bars(pd.DataFrame({"t": times, "r": [0.5, 1.0]}), "t", "r", "Prefix-cache hit rate per 1 min bucket", 60.0),
    ]
    for figure in figures:
        title = figure.layout.title
        assert (title.yref, title.y, title.yanchor, title.xanchor) == ("paper", 1, "bottom", "left"), title
        assert figure.layout.margin.t >= charts.TOOLBAR_PX + title.font.size + title.pad.b, figure.layout.margin
