"""Evictions: the persisted eviction log of every run, filtered, paged, exported and charted."""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone

import pandas as pd
import streamlit as st

from app import charts
from app.frames import utc_csv
from app.hosting import get_host
from app.ui import fmt_duration, fmt_time, kept, read_history, wait_for_history
from engine.core.events import EvictReason
from storage.read import queries
from storage.read.queries import EvictionFilters

ALL_RUNS = "all runs"
RANGES = {"All time": None, "Last 15 minutes": 900, "Last hour": 3600, "Last 24 hours": 86400, "Custom": None}
PAGE_SIZES = (25, 50, 100, 200)

host = get_host()
state = st.session_state

st.title("Evictions")
st.caption("Every block that lost its key, persisted by the history writer: this run and earlier ones.")
st.button("Refresh", key="evict_refresh")
wait_for_history(host)  # what this operator just did (a reset, a release) is in before the page reads

runs = read_history(queries.runs, host.db, limit=500)
if runs is None:
    st.stop()
current_run = host.console.run_id
run_labels = {ALL_RUNS: "All runs"}
for run in runs.itertuples():
    run_labels[run.id] = (
        f"{run.id} · {run.model} · {run.num_blocks}×{run.block_size}" + (" (current)" if run.id == current_run else "")
        + (" (interrupted)" if run.end_reason == "interrupted" else "")
    )
interrupted = read_history(queries.interrupted_runs, host.db)
for run in [] if interrupted is None else interrupted.itertuples():
    st.warning(
        f"Run {run.id} interrupted (closed at next start): its server and history writer died without stopping it; "
        f"last seen {fmt_time(run.stopped_at)}. Its requests still waiting or running then are marked interrupted."
    )

# ---------------------------------------------------------------- filters
c = st.columns([2, 1, 2])
if state.get("evict_run") not in run_labels:
    state["evict_run"] = ALL_RUNS
run_id = c[0].selectbox("Run", list(run_labels), **kept("evict_run", ALL_RUNS), format_func=run_labels.get)
time_range = c[1].selectbox("Time range", list(RANGES), **kept("evict_range", "All time"))
reasons = c[2].multiselect("Reason", [r.value for r in EvictReason], **kept("evict_reasons", []), placeholder="all reasons")
c = st.columns([2, 2, 1])
request_id = c[0].text_input("Request (whose allocation evicted it)", **kept("evict_request", "")).strip()
key_prefix = c[1].text_input("Key prefix (hex)", **kept("evict_key_prefix", "")).strip()
page_size = c[2].selectbox("Rows per page", PAGE_SIZES, **kept("evict_page_size", 50))

since = until = None
problems = []
if time_range == "Custom":
    now = datetime.now(tz=timezone.utc).replace(microsecond=0)
    c = st.columns(2)
    start = c[0].datetime_input("From (UTC)", **kept("evict_since", now.replace(hour=0, minute=0, second=0)))
    end = c[1].datetime_input("Until (UTC)", **kept("evict_until", now.replace(hour=23, minute=59, second=59)))
    since = start.replace(tzinfo=timezone.utc).timestamp() if start.tzinfo is None else start.timestamp()
    until = end.replace(tzinfo=timezone.utc).timestamp() if end.tzinfo is None else end.timestamp()
    if since >= until:
        problems.append("the start of the time range must be before its end")
elif RANGES[time_range] is not None:
    since = time.time() - RANGES[time_range]
if key_prefix and not re.fullmatch(r"[0-9a-fA-F]+", key_prefix):
    problems.append(f"key prefix must be hex digits, got {key_prefix!r}")
if problems:
    for problem in problems:
        st.error(f"Filter not applied: {problem}.")
    st.stop()

filters = EvictionFilters(
    since=since,
    until=until,
    reasons=tuple(reasons),
    request_id=request_id or None,
    run_id=None if run_id == ALL_RUNS else run_id,
    key_prefix=key_prefix.lower() or None,
)

# ---------------------------------------------------------------- the log, one keyset page at a time
signature = (run_id, time_range, tuple(reasons), request_id, key_prefix.lower(), page_size, since if time_range == "Custom" else None, until)
if state.get("evict_signature") != signature:
    state["evict_signature"] = signature
    state["evict_cursors"] = [None]  # the cursor each visited page started after; [-1] is this page


def older() -> None:
    state["evict_cursors"].append(state["evict_next"])


def newer() -> None:
    if len(state["evict_cursors"]) > 1:
        state["evict_cursors"].pop()


total = read_history(queries.eviction_count, host.db, filters)
page = read_history(queries.eviction_log, host.db, filters, int(page_size), after=state["evict_cursors"][-1])
if total is None or page is None:
    st.stop()
state["evict_next"] = page.next_cursor
first_row = (len(state["evict_cursors"]) - 1) * int(page_size) + 1

st.subheader(f"{total:,} eviction{'' if total == 1 else 's'}")
rows = page.rows.copy()
if rows.empty:
    st.info("No evictions match these filters." if total == 0 else "No more rows.")
else:
    st.caption(f"Rows {first_row:,}–{first_row + len(rows) - 1:,}, newest first")
    rows["time"] = pd.to_datetime(rows["time"], unit="s", utc=True)
    rows["last_used"] = pd.to_datetime(rows["last_used"], unit="s", utc=True)
    st.dataframe(
        rows,
        hide_index=True,
        column_config={
            "time": st.column_config.DatetimeColumn("time (UTC)", format="YYYY-MM-DD HH:mm:ss.SSS"),
            "last_used": st.column_config.DatetimeColumn("last used (UTC)", format="YYYY-MM-DD HH:mm:ss"),
            "age_s": st.column_config.NumberColumn("age at eviction (s)", format="%.2f"),
            "hit_count": st.column_config.NumberColumn("hits"),
            "key_hex": st.column_config.TextColumn("key"),
        },
    )
c = st.columns([1, 1, 4])
c[0].button("← Newer", key="evict_newer", on_click=newer, disabled=len(state["evict_cursors"]) == 1)
c[1].button("Older →", key="evict_older", on_click=older, disabled=page.next_cursor is None)
c[2].download_button(
    "Export CSV (all matching rows)",
    data=lambda: utc_csv(queries.export_evictions_csv(host.db, filters)),  # times in UTC, as the page shows them
    file_name=f"evictions-{int(time.time())}.csv",
    mime="text/csv",
    key="evict_export",
    on_click="ignore",
    disabled=total == 0,
)

# ---------------------------------------------------------------- charts
st.subheader("Charts")
bucket = st.select_slider("Bucket", options=[10, 60, 300, 3600, 86400], format_func=fmt_duration, **kept("evict_bucket", 60))
over_time = read_history(queries.evictions_over_time, host.db, float(bucket), filters)
ages = read_history(queries.age_at_eviction_histogram, host.db, filters)
hits = read_history(queries.hits_before_eviction_histogram, host.db, filters)
if over_time is not None and not over_time.empty:
    over_time["time"] = pd.to_datetime(over_time["bucket_start"], unit="s", utc=True)
    st.plotly_chart(
        charts.stacked_bars(over_time, "time", "evictions", "reason", f"Evictions per {fmt_duration(bucket)}", float(bucket))
    )
left, right = st.columns(2)
if ages is not None:
    left.plotly_chart(charts.histogram_bars(ages, "Age at eviction", "s"))
if hits is not None:
    right.plotly_chart(charts.histogram_bars(hits, "Prefix hits before eviction", ""))
st.caption(f"Read {fmt_time(time.time())}.")
