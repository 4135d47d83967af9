"""Overview: the cache's headline numbers now, and how they moved."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from app import charts
from app.frames import Headline, capacity_evictions, headline, history_frame, window_drops
from app.hosting import get_host
from app.tiers import TIER_OFF, hits_by_tier, idle_tier_warning, tier_table
from app.ui import REFRESH_S, SLOW_REFRESH_S, fmt_duration, kept, read_history, wait_for_history
from engine.core.snapshot import PoolStats
from storage.read import queries

host = get_host()

st.title("Overview")
st.caption("Shared by every operator: all sessions see the same engine and cache. Numbers refresh live.")


def reuse_numbers(stats: PoolStats, numbers: Headline) -> None:
    """Reuse in tokens, each number for what it is: prefix-index hits (vLLM's metric), fork sharing,
    what neither computed, and what was computed again (replays, re-prefills after preemption)."""
    st.subheader("Reuse")
    c = st.columns(5)
    c[0].metric(
        "Prefix-cache hit rate",
        f"{stats.prefix_hit_rate:.1%}",
        help="vLLM's prefix_cache_hits / prefix_cache_queries, in tokens: prompt tokens of new requests found "
        "in the prefix index and not computed, over the prompt tokens looked up. Fork children and re-prefills "
        "after a preemption are not lookups and are not in it; replayed tokens are not hits.",
    )
    c[0].caption(f"{stats.prefix_hit_tokens:,} of {stats.prefix_query_tokens:,} prompt tokens")
    by_tier = hits_by_tier(stats)
    if by_tier is not None:
        c[0].caption(f"from {by_tier}")
    c[1].metric(
        "Fork sharing",
        f"{stats.fork_share_rate:.1%}",
        help="Context tokens fork children shared from their parent's blocks, over their context tokens "
        "(sharing a table, not a prefix-index lookup)",
    )
    c[1].caption(f"{stats.fork_shared_tokens:,} of {stats.fork_query_tokens:,} context tokens")
    c[2].metric(
        "Tokens saved",
        f"{numbers.tokens_saved:,}",
        help="Prompt tokens not computed: prefix hits plus fork sharing. Tokens replayed to rebuild "
        "sliding-window state were computed, so they are not saved.",
    )
    c[2].caption("not computed: prefix hits + fork sharing")
    c[3].metric(
        "Prefill time saved",
        fmt_duration(numbers.prefill_seconds_saved),
        help="Estimate: tokens saved × measured prefill seconds per token"
        + ("" if numbers.seconds_per_token is None else f" ({numbers.seconds_per_token * 1000:.2f} ms/token)"),
    )
    c[4].metric(
        "Replayed tokens",
        f"{stats.replayed_tokens:,}",
        help="Tokens of sliding-window hits computed again to rebuild the window state ([r, h)): not saved",
    )
    c = st.columns(5)
    c[0].metric("Copy-on-write copies", f"{stats.cow_copies:,}")
    c[1].metric("Preemptions", f"{stats.preemptions:,}")
    c[2].metric(
        "Re-prefill from cache",
        f"{stats.preempted_hit_tokens:,}",
        help="Tokens a preempted request found in the cache when it was admitted again: its own KV, "
        "counted here and not as prefix hits (vLLM #25780)",
    )
    c[2].caption(f"of {stats.preempted_query_tokens:,} tokens looked up again after preemption")


def kv_tiers(stats: PoolStats) -> None:
    """Each KV tier's occupancy, hits, traffic and losses side by side; a disk tier that stores and never
    loads is flagged."""
    st.subheader("KV tiers")
    warning = idle_tier_warning(stats.tier)
    if warning is not None:
        st.warning(warning, icon="⚠️")
    st.table(tier_table(stats))
    if stats.tier is None:
        st.caption(TIER_OFF)
    else:
        st.caption(
            "Hit tokens: prefix-hit tokens each tier served (memory: found in the pool; disk: promoted into it). "
            "Stores: evicted blocks written to disk; loads: blocks read back. Drops: evicted blocks the tier "
            "did not take (full of blocks being written, or its writer behind); corrupt: loads whose checksum "
            "failed (recomputed, never served)."
        )


@st.fragment(run_every=REFRESH_S * 2)
def headline_numbers() -> None:
    console = host.console
    engine = console.engine
    now = time.time()
    stats = engine.stats()
    console.history.offer(now, stats)  # so the charts reach "now" while the engine idles
    numbers = headline(stats, engine.requests(), console.history.samples(), now)
    stats = numbers.stats

    st.subheader("KV pool")
    c = st.columns(5)
    c[0].metric("KV usage", f"{stats.kv_usage:.1%}", help="Referenced blocks over the pool")
    c[1].metric("Blocks free", f"{stats.free_blocks:,}", help="No reference, no key: handed out first")
    c[2].metric("Blocks cached", f"{stats.evictable_blocks:,}", help="Unreferenced but keyed: kept for prefix hits, evicted LRU-first")
    c[3].metric("Blocks referenced", f"{stats.used_blocks:,}", help="Held by running or retained requests")
    c[4].metric("Sharing ratio", f"{stats.sharing_ratio:.2f}×", help="Logical block-table entries over physical referenced blocks")

    if len(stats.groups) > 1:  # hybrid models: full-attention and sliding-window layers pool separately
        st.table(
            pd.DataFrame(
                {
                    "KV group": [g.name for g in stats.groups],
                    "window": ["full attention" if g.window is None else f"{g.window} tokens" for g in stats.groups],
                    "free": [g.free_blocks for g in stats.groups],
                    "cached": [g.evictable_blocks for g in stats.groups],
                    "referenced": [g.used_blocks for g in stats.groups],
                    "evictions": [g.evictions for g in stats.groups],
                    "copy-on-write": [g.cow_copies for g in stats.groups],
                    "released outside the window": [g.window_released_blocks for g in stats.groups],
                }
            )
        )

    kv_tiers(stats)
    reuse_numbers(stats, numbers)

    st.subheader("Churn and queue")
    c = st.columns(6)
    rate, drops = numbers.evictions_per_min, numbers.window_drops_per_min
    c[0].metric("Evictions / min", "—" if rate is None else f"{rate:.1f}",
                help="Cached blocks dropped to make room (or by a reset), over the last minute; sliding-window "
                "drops are counted apart")  # fmt: skip
    c[1].metric("Evictions (total)", f"{capacity_evictions(stats):,}", help="Since the engine started; window drops apart")
    c[2].metric("Window drops / min", "—" if drops is None else f"{drops:.1f}",
                help="Sliding-window state dropped because it left the window: the window's rule, not a full "
                "pool (reason `window` in the history)")  # fmt: skip
    c[2].caption(f"{window_drops(stats):,} in all")
    c[3].metric("Running", stats.num_running)
    c[4].metric("Waiting", stats.num_waiting)
    c[5].metric("Retained", stats.num_retained)

    writer = host.writer_stats()
    st.subheader("History writer")
    c = st.columns(7)
    c[0].metric("Rows dropped", f"{writer.dropped:,}", help="Rows that will never be written (queue full, batch given up, writer process killed)")
    c[1].metric("Failed batches", f"{writer.failed_batches:,}")
    c[2].metric("Queued rows", f"{writer.queued:,}")
    c[3].metric("History lag", fmt_duration(writer.lag_s), help="Age of the oldest row handed to the writer and not yet written (0 when none)")
    c[4].metric("Events written", f"{writer.written_events:,}")
    c[5].metric("Retrying", "yes" if writer.retrying else "no")
    c[6].metric("Writer restarts", f"{writer.restarts:,}", help="Writer processes started again after one exited unexpectedly")
    if writer.last_error:
        st.caption(f"Last writer error: `{writer.last_error}`")
    if console.listener_errors:
        st.error(f"{console.listener_errors} engine-listener calls failed; see the server log.")



headline_numbers()


@st.fragment(run_every=SLOW_REFRESH_S)
def history_charts() -> None:
    frame = history_frame(host.console.history.samples())
    if len(frame) >= 2:
        left, right = st.columns(2)
        left.plotly_chart(charts.history_lines(frame, ["KV usage", "prefix hit rate", "fork sharing"], "KV usage and hit rate", percent=True))
        # Free blocks apart: on an idle pool they dwarf the lines that move (the KV usage chart has them as a share).
        right.plotly_chart(charts.history_lines(frame, ["cached (evictable)", "referenced"], "Blocks by state (free: the rest of the pool)"))
        left, right = st.columns(2)
        left.plotly_chart(charts.history_lines(frame, ["evictions", "window drops", "cow copies", "preemptions"], "Evictions, window drops, copies, preemptions (totals)"))
        right.plotly_chart(charts.history_lines(frame, ["sharing ratio"], "Sharing ratio"))
    else:
        st.info("Charts appear once the engine has run a few steps.")


history_charts()

st.subheader("Over time (history database)")
st.caption(
    "Per bucket, from the stored history: prefix-cache hits (vLLM's metric, in tokens not computed) and fork "
    "sharing by first-schedule time, each on its own; evictions for room apart from sliding-window drops."
)
RANGES = {"Last 15 min": 900.0, "Last hour": 3600.0, "This run": None, "All runs": None}  # seconds back, or a scope
if st.session_state.get("overview_hit_scope", "This run") not in RANGES:  # a choice an older page kept
    st.session_state["overview_hit_scope"] = "This run"
scope = st.radio("Range", list(RANGES), horizontal=True, **kept("overview_hit_scope", "This run"))
bucket = st.select_slider("Bucket", options=[10, 60, 300, 3600], format_func=fmt_duration, **kept("overview_bucket", 60))


@st.fragment(run_every=SLOW_REFRESH_S)
def stored_hit_rate() -> None:
    run_id = host.console.run_id if scope == "This run" else None
    since = None if RANGES[scope] is None else time.time() - RANGES[scope]
    wait_for_history(host)
    evicted = read_history(
        queries.evictions_over_time, host.db, float(bucket), queries.EvictionFilters(since=since, run_id=run_id)
    )
    frame = read_history(queries.hit_rate_over_time, host.db, bucket_seconds=float(bucket), run_id=run_id, since=since)
    if frame is None:
        return
    if frame.empty:
        st.info("No scheduled requests recorded yet.")
        return
    frame["time"] = pd.to_datetime(frame["bucket_start"], unit="s", utc=True)
    left, right = st.columns(2)
    width = fmt_duration(bucket)
    left.plotly_chart(charts.rate_bars(frame, "time", "hit_rate", f"Prefix-cache hit rate per {width} bucket", float(bucket)))
    right.plotly_chart(charts.rate_bars(frame, "time", "fork_share", f"Fork sharing per {width} bucket", float(bucket)))
    if evicted is not None and not evicted.empty:
        evicted["kind"] = ["window drop" if reason == "window" else "eviction (for room or reset)" for reason in evicted["reason"]]
        evicted["time"] = pd.to_datetime(evicted["bucket_start"], unit="s", utc=True)
        per_kind = evicted.groupby(["time", "kind"], as_index=False)["evictions"].sum()
        st.plotly_chart(charts.stacked_bars(per_kind, "time", "evictions", "kind",
                                            f"Evictions and window drops per {width} bucket", float(bucket)))  # fmt: skip


stored_hit_rate()
