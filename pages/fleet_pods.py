"""Fleet pods: every watched vLLM / SGLang server's prefix cache — blocks held, rates, KV usage, hit rate."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from app import fleet_charts
from app.fleet_hosting import ENV_FLEET_PODS, get_fleet_host
from app.fleet_tiers import tier_frame
from app.fleet_view import history_pods, live_pods, metrics_frame, metrics_summary, scrapes_from_history
from app.hosting import get_host
from app.ui import LIVE, SLOW_REFRESH_S, fleet_source, fmt_duration, kept, read_history
from fleet.source import parse_pods
from storage.read import fleet_queries

RATE_WINDOWS = {"Last 5 minutes": 300, "Last 15 minutes": 900, "Last hour": 3600}
# The table's columns, so it fits the page; the rest of each row (ids, endpoints, feed counters) is in the
# data (and in Feed health below).
MAIN_COLUMNS = (
    "pod", "status", "blocks", "capacity", "kv_usage", "hit_rate", "lifetime_hit_rate", "last_batch_s_ago",
    "link", "restarts", "lost_batches",
)  # fmt: skip

host = get_host()
fleet = get_fleet_host()

st.title("Fleet pods")
st.caption(
    "vLLM and SGLang servers watched through their KV events (the feed llm-d and Dynamo consume). "
    "The history database holds what every collector sharing it saw; this console's own collector, "
    "when it runs, also keeps a live index and scrapes each pod's /metrics."
)
if fleet.start_error:
    st.error(f"The fleet collector did not start: {fleet.start_error}")
feed_error = host.console.feed_error
if feed_error:
    st.warning(f"This console's engine could not publish its KV-event feed or metrics: {feed_error}")

watch = fleet.watch
c = st.columns([3, 2])
view = fleet_source(c[0], "fleet_view", live=watch is not None)
window = c[1].selectbox("Rates over", list(RATE_WINDOWS), **kept("fleet_rate_window", "Last 5 minutes"))


@st.fragment(run_every=SLOW_REFRESH_S)
def pods() -> None:
    now = time.time()
    if view == LIVE and watch is not None:
        writer = watch.writer.stats()
        st.caption(  # in the fragment, so its counts stay current
            f"Collector `{watch.store.collector_id}` running for {fmt_duration(now - watch.started_at)}, "
            f"writing to the history database: {writer.written_other:,} rows written, {writer.dropped:,} dropped."
        )
        scrapes = {pod.name: watch.index.metrics(pod.name) for pod in watch.pods}
        metrics = {name: metrics_summary(found) for name, found in scrapes.items()}
        frame = live_pods(watch.index.pods(now), watch.collector.stats(), metrics)
        source_ids = watch.store.source_ids()
    else:
        frame = read_history(history_pods, host.db, now, fleet.stale_after_s)
        if frame is None:
            return
        source_ids = dict(zip(frame["pod"], frame["source_id"])) if len(frame) else {}
        scrapes = {}
    if frame.empty:
        st.info(
            f"No pods yet. Start a collector below, set ${ENV_FLEET_PODS}, or run "
            "`python -m cli fleet watch --pod NAME=tcp://HOST:PORT,replay=tcp://HOST:PORT --db URL` on this database."
        )
        return
    stale = frame[frame["stale"]]["pod"].tolist()
    held, capacity = int(frame["blocks"].sum()), frame["capacity"].dropna()
    c = st.columns(4)
    c[0].metric("Pods", len(frame))
    c[1].metric("Live or idle", int(frame["status"].isin(["live", "idle"]).sum()))
    c[2].metric("Stale", len(stale), help="Down, unreachable, or silent with no link known: blocks as last seen")
    c[3].metric(
        "Blocks held / capacity",
        f"{held:,} / {int(capacity.sum()):,}" if len(capacity) == len(frame) else f"{held:,}",
        help="Physical blocks held, every pod, medium and group; capacity from each pod's cache_config_info",
    )
    if stale:
        statuses = ", ".join(f"{pod} ({status})" for pod, status in zip(frame["pod"], frame["status"]) if pod in stale)
        st.warning(f"Stale (blocks as last seen): {statuses}")
    columns = {
        "kv_usage": st.column_config.ProgressColumn("KV usage", format="percent", min_value=0.0, max_value=1.0),
        "hit_rate": st.column_config.NumberColumn(
            "hit rate (1 min)", format="percent", help="Prefix-cache hits / queries in tokens over the last minute"
        ),
        "lifetime_hit_rate": st.column_config.NumberColumn(
            "hit rate (lifetime)", format="percent", help="Since the server started"
        ),
        "last_batch_s_ago": st.column_config.NumberColumn("last batch (s ago)", format="%.1f"),
        "lost_batches": st.column_config.NumberColumn("lost batches", help="Neither live nor replay delivered"),
        "lag_ms": st.column_config.NumberColumn("lag (ms)", format="%.1f"),
        "catch-ups": st.column_config.NumberColumn(
            "catch-ups", help="Replay requests (at start, on each new connection, after a quiet spell, for a gap)"
        ),
    }
    shown = [name for name in MAIN_COLUMNS if name in frame.columns]
    shown += [name for name in frame.columns if name.endswith(" blocks")]  # blocks per medium
    st.dataframe(
        frame, hide_index=True, column_config=columns, column_order=shown, key="fleet_pods_table", width="stretch"
    )
    st.caption("Feed counters (batches, catch-ups, errors, lag) per pod: in Feed health below.")
    tiers = tier_frame(frame)
    if tiers["tier"].nunique() > 1:  # a server with a second tier (vLLM's offloading, this engine's disk tier)
        st.subheader("Held blocks per tier")
        st.caption(
            "Each KV event names the medium its blocks live in: GPU or CPU for a server's pool, CPU (vLLM's "
            "offloading connector), DISK (this engine's disk tier) or STORAGE (vLLM's file tier) for a second "
            "tier. Share of pod: of the pod's held blocks; share of tier: of every pod's blocks in that tier."
        )
        share = {"format": "percent", "min_value": 0.0, "max_value": 1.0}
        st.dataframe(
            tiers,
            hide_index=True,
            column_config={
                "share of pod": st.column_config.ProgressColumn("share of pod", **share),
                "share of tier": st.column_config.ProgressColumn("share of tier", **share),
            },
            key="fleet_pods_tiers",
        )
    if view == LIVE and watch is not None:
        with_metrics = [name for name, found in scrapes.items() if found]
    else:
        with_metrics = [pod for pod, url in zip(frame["pod"], frame["metrics_url"]) if isinstance(url, str)]
    if with_metrics:
        chosen = st.selectbox("Metrics of", with_metrics, key="fleet_metrics_pod")
        if view == LIVE and watch is not None:
            found = scrapes[chosen]
        else:
            since = now - RATE_WINDOWS[window]
            stored = read_history(fleet_queries.metrics_history, host.db, [source_ids[chosen]], since)
            found = [] if stored is None else scrapes_from_history(stored, chosen)
        if found:
            st.plotly_chart(fleet_charts.pod_metrics_lines(metrics_frame(found), chosen), key="fleet_metrics_chart")

    since = now - RATE_WINDOWS[window]
    bucket = 10.0 if RATE_WINDOWS[window] <= 900 else 60.0
    rates = read_history(fleet_queries.block_rates, host.db, list(source_ids.values()), since, bucket)
    if rates is not None and not rates.empty:
        pod_of = {source: pod for pod, source in source_ids.items()}
        rates["pod"] = rates["source_id"].map(pod_of)
        st.plotly_chart(fleet_charts.block_rate_lines(rates, bucket), key="fleet_rates")
    elif rates is not None:
        st.caption(f"No blocks stored or removed in the {window.lower()}.")


pods()


with st.expander("Collector in this console", expanded=watch is None):
    st.caption(
        f"One pod per line (or set ${ENV_FLEET_PODS} before starting the console): "
        "`NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,metrics=http://HOST:PORT/metrics][,topic=TOPIC]`"
    )
    running = "\n".join(
        f"{pod.name}={pod.endpoint}"
        + (f",replay={pod.replay_endpoint}" if pod.replay_endpoint else "")
        + (f",metrics={pod.metrics_url}" if pod.metrics_url else "")
        + (f",topic={pod.topic}" if pod.topic else "")
        for pod in (watch.pods if watch is not None else ())
    )
    with st.form("fleet_collector_form"):
        text = st.text_area("Pods", value=running, height=120, max_chars=20_000)
        c = st.columns([1, 1, 4])
        start = c[0].form_submit_button("Start" if watch is None else "Restart", type="primary")
        stop = c[1].form_submit_button("Stop", disabled=watch is None)
    if start:
        try:
            fleet.start(parse_pods(text))
        except ValueError as exc:
            st.error(f"Not started: {exc}")
        else:
            st.session_state["fleet_view"] = LIVE  # what was just started is seen live, not in the history
            st.rerun()
    if stop:
        fleet.stop()
        st.rerun()
if watch is not None:
    with st.expander("Feed health (per pod subscriber)"):
        health = [
            {
                "pod": s.pod,
                "ready": s.ready,
                "link": s.link.value,
                "connects": s.num_connects,
                "lag (ms)": None if s.last_lag_s is None else round(s.last_lag_s * 1e3, 1),
                "batches": s.num_batches,
                "catch-ups": s.num_replays,
                "batches replayed": s.num_replayed_batches,
                "gaps": s.num_gaps,
                "lost": s.num_lost_batches,
                "replay timeouts": s.num_replay_timeouts,
                "restarts": s.num_restarts,
                "errors": s.num_errors,
                "last error": s.last_error,
            }
            for s in watch.collector.stats().values()
        ]
        st.dataframe(pd.DataFrame(health), hide_index=True)
