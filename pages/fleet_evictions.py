"""Fleet evictions and lifetimes: what the pods' caches let go, how old it was, and how long blocks lived."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from app import charts, fleet_charts
from app.fleet_hosting import get_fleet_host
from app.fleet_view import idle_before_evict_frame, short_hash
from app.hosting import get_host
from app.ui import LIVE, fleet_source, fmt_time, kept, read_history
from storage.read import fleet_queries

RANGES = {"Last 15 minutes": 900, "Last hour": 3600, "Last 24 hours": 86400, "All time": None}
LOG_ROWS = (50, 100, 500)

host = get_host()
fleet = get_fleet_host()

st.title("Fleet evictions and lifetimes")
st.caption(
    "From the history database (every collector sharing it). An eviction is one physical copy a "
    "BlockRemoved took away, aged from the store that made its hash held; a lifetime runs from that "
    "store until the hash's last copy goes: removed, or dropped by a cache reset (cleared) or a "
    "server restart (reset). The log lists all three. Idle before eviction (the figure cache tuning "
    "needs: how long an evicted block went unused) is vLLM's own histogram, from pods run with "
    "`--kv-cache-metrics` whose /metrics this console's collector scrapes."
)
watch = fleet.watch
c = st.columns([3, 1])
view = fleet_source(c[0], "fleet_evict_view", live=watch is not None)
full_hashes = c[1].toggle("Full hashes", **kept("fleet_evict_full_hashes", False))
st.button("Refresh", key="fleet_evict_refresh")

sources = read_history(fleet_queries.latest_sources, host.db)
if sources is None:
    st.stop()
if view == LIVE and watch is not None:  # this console's collector: its own sources
    sources = sources[sources["id"].isin(list(watch.store.source_ids().values()))]
if sources.empty:
    st.info("No pods in the history database yet.")
    st.stop()
pods = sources["pod"].tolist()
c = st.columns([3, 1, 1])
chosen = c[0].multiselect("Pods", pods, **kept("fleet_evict_pods", []), placeholder="all pods")
time_range = c[1].selectbox("Time range", list(RANGES), **kept("fleet_evict_range", "Last hour"))
limit = c[2].selectbox("Log rows", LOG_ROWS, **kept("fleet_evict_rows", 50))
chosen_sources = sources[sources["pod"].isin(chosen)] if chosen else sources
source_ids = chosen_sources["id"].tolist()
pod_of = dict(zip(sources["id"], sources["pod"]))
since = None if RANGES[time_range] is None else time.time() - RANGES[time_range]

ages = read_history(fleet_queries.eviction_age_histogram, host.db, source_ids, since)
lifetimes = read_history(fleet_queries.lifetime_histogram, host.db, source_ids, since)
log = read_history(fleet_queries.eviction_log, host.db, source_ids, since, int(limit))
if ages is None or lifetimes is None or log is None:
    st.stop()

known = ages.dropna(subset=["bin_start"])
unknown = int(ages[ages["bin_start"].isna()]["evictions"].sum())
c = st.columns(3)
c[0].metric("Evictions", f"{int(ages['evictions'].sum()):,}")
c[1].metric("Of unknown age", f"{unknown:,}", help="Removals of hashes the collector did not see stored (joined late, or a gap)")
c[2].metric("Lifetimes ended", f"{int(lifetimes['lifetimes'].sum()) if len(lifetimes) else 0:,}")

left, middle, right = st.columns(3)
left.plotly_chart(charts.histogram_bars(known, "Age at eviction", "s"), key="fleet_age_chart")
if len(lifetimes):
    middle.plotly_chart(
        fleet_charts.binned_bars(lifetimes, "lifetimes", "Lifetimes by how they ended", colour="reason"),
        key="fleet_lifetime_chart",
    )
else:
    middle.info("No lifetime ended in this range.")
idle = pd.DataFrame(columns=["bin_start", "bin_end", "evictions"])
if watch is not None:
    window_start = since or 0.0
    for pod in chosen_sources["pod"]:
        scrapes = [scrape for scrape in watch.index.metrics(pod) if scrape.at >= window_start]
        part = idle_before_evict_frame(scrapes)
        idle = part if idle.empty else idle.assign(evictions=idle["evictions"].add(part["evictions"], fill_value=0))
if idle.empty or not idle["evictions"].sum():
    right.info(
        "Idle before eviction: no vLLM histogram in this range. It needs this console's collector scraping "
        "the pods' /metrics (metrics=URL) and vLLM run with --kv-cache-metrics."
    )
else:
    right.plotly_chart(charts.histogram_bars(idle, "Idle before eviction (vLLM)", "s"), key="fleet_idle_chart")

st.subheader("Eviction log")
if log.empty:
    st.info("No evictions in this range.")
else:
    log.insert(1, "pod", log.pop("source_id").map(pod_of))
    log["time"] = pd.to_datetime(log["time"], unit="s", utc=True)
    if not full_hashes:
        log["block_hash"] = log["block_hash"].map(short_hash)
    st.dataframe(
        log,
        hide_index=True,
        column_config={
            "time": st.column_config.DatetimeColumn("time (UTC)", format="YYYY-MM-DD HH:mm:ss.SSS"),
            "age_s": st.column_config.NumberColumn("age at eviction (s)", format="%.2f"),
            "copies_left": st.column_config.NumberColumn("copies left"),
            "block_hash": st.column_config.TextColumn("hash"),
        },
        key="fleet_evict_log",
    )
st.caption(f"Read {fmt_time(time.time())}.")
