"""Settings: what the engine runs with, the history database, and the two destructive actions
(reset the prefix cache, restart the engine with a new configuration), each behind a confirmation."""

from __future__ import annotations

import dataclasses
import os
import time

import pandas as pd
import streamlit as st
from sqlalchemy import make_url

from app.hosting import get_host
from app.tiers import MAX_CONSOLE_OFFLOAD_GIB, check_offload
from app.ui import api_text, expect_in_history, fmt_duration, fmt_time, threads_text
from engine.core.config import DTYPES, MAX_BATCHED_TOKENS, MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, EngineConfig
from engine.core.eviction import EvictionPolicyName
from engine.core.kv_memory import check_pool_fits, kv_bytes_per_block, machine_memory_bytes, pool_bytes
from engine.runner.model_loading import PRESETS, available_devices, resolve_device

LOCAL_DIRECTORY = "local directory…"
LAYOUTS = ("", "sliding", "hybrid")
LAYOUT_LABELS = {"": "as the model defines it", "sliding": "every layer sliding", "hybrid": "hybrid: even layers sliding"}

host = get_host()
console = host.console
engine = console.engine
config = console.config
state = st.session_state


def flash(kind: str, message: str) -> None:
    """A message shown once, after the rerun that follows an action."""
    state["settings_flash"] = (kind, message)


def bytes_per_block(dtype: str, block_size: int) -> int:
    """Bytes one block takes over every layer of the running model, K and V."""
    shape = engine.loaded
    return kv_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, block_size)


def new_bytes_per_block(new: EngineConfig) -> int | None:
    """`bytes_per_block` for `new` when it runs the current model (other models are only known once loaded)."""
    if new.model != config.model or new.num_blocks is None:
        return None
    return bytes_per_block(new.dtype, new.block_size)


def tier_text(running: EngineConfig, tier) -> str:
    """The running engine's disk tier: off, or its directory, size and slots."""
    if running.offload_dir is None or tier is None:
        return "off (evicted blocks are dropped)"
    return f"{running.offload_dir}, {running.offload_gib:g} GiB ({tier.num_slots:,} blocks)"


st.title("Settings")
if "settings_flash" in state:
    kind, message = state.pop("settings_flash")
    getattr(st, kind)(message)

# ---------------------------------------------------------------- what runs now
st.subheader("Running engine")
loaded = engine.loaded
groups = [g.name for g in engine.stats().groups]
st.table(
    pd.DataFrame(
        {
            "setting": [
                "model", "weights revision", "device", "dtype", "forward", "attention kernels", "pool", "eviction policy", "KV pool memory",
                "disk KV tier", "max batched tokens", "max running requests", "forward threads", "seed", "data directory",
                "run", "started", "OpenAI-compatible API",
            ],
            "value": [
                loaded.model_id,
                loaded.weights_revision[:16] + "…",
                str(loaded.device),
                config.dtype,
                engine.runner.forward_path,
                engine.runner.kernels.summary(),
                f"{engine.num_blocks:,} blocks × {config.block_size} tokens"
                + (f" per KV group ({', '.join(groups)})" if len(groups) > 1 else ""),
                config.eviction_policy.value,
                f"{pool_bytes(engine.num_blocks, bytes_per_block(config.dtype, config.block_size)) / 2**20:,.1f} MiB",
                tier_text(config, engine.stats().tier),
                f"{config.max_num_batched_tokens:,}",
                f"{config.max_num_seqs:,}",
                threads_text(engine.forward_threads(), engine.forward_time_at_threads()),
                str(config.seed),
                str(config.resolved_data_dir),
                console.run_id,
                f"{fmt_time(console.started_at)} ({fmt_duration(time.time() - console.started_at)} ago)",
                api_text(host.api_url),
            ],
        }
    )
)

# ---------------------------------------------------------------- database
st.subheader("History database")
url = make_url(host.db_url)
st.markdown(f"URL: `{url.render_as_string(hide_password=True)}`")
if url.get_backend_name() == "sqlite" and url.database:
    st.markdown(f"SQLite file: `{os.path.abspath(url.database)}`")
writer = host.writer_stats()
st.caption(
    f"writer: {writer.written_events:,} events and {writer.written_requests:,} request records written in "
    f"{writer.written_batches:,} transactions · {writer.queued:,} rows queued · {writer.dropped:,} dropped · "
    f"{writer.failed_batches:,} failed batches · {writer.pruned_rows:,} pruned by retention · lag "
    f"{fmt_duration(writer.lag_s)} · {writer.restarts:,} writer restarts"
)
if host.schema_error:
    st.error(f"Schema upgrade failed at start: {host.schema_error}")
if writer.last_error:
    st.warning(f"Last writer error: {writer.last_error}")

# ---------------------------------------------------------------- reset
st.subheader("Reset the prefix cache")
st.caption(
    "Evicts every unreferenced cached block for every operator (for example after a weight update). "
    "Blocks held by running or retained requests stay; the result says whether the cache is now empty."
)
if state.get("settings_confirm") != "reset":
    if st.button("Reset prefix cache…", key="settings_reset"):
        state["settings_confirm"] = "reset"
        st.rerun()
else:
    st.warning(f"Reset the prefix cache of the shared engine? {engine.stats().evictable_blocks:,} cached blocks would be evicted.")
    c = st.columns([1, 1, 4])
    if c[0].button("Confirm reset", type="primary", key="settings_reset_confirm"):
        result = engine.reset_cache()
        expect_in_history(host, "the reset's evictions")
        state.pop("settings_confirm")
        if result.ok:
            flash("success", f"Prefix cache reset: {result.dropped_blocks:,} blocks evicted; the cache is empty.")
        else:
            flash(
                "warning",
                f"Prefix cache partly reset: {result.dropped_blocks:,} blocks evicted, {result.kept_blocks:,} cached "
                "blocks kept because running or retained requests hold them.",
            )
        st.rerun()
    if c[1].button("Cancel", key="settings_reset_cancel"):
        state.pop("settings_confirm")
        st.rerun()

# ---------------------------------------------------------------- restart
st.subheader("Restart the engine")
st.caption(
    "Builds a new engine with these settings, then replaces the running one: every request and every "
    "cached block is dropped, for every operator. The history keeps the old run."
)
models = list(PRESETS)
current_model = config.model if config.model in models else LOCAL_DIRECTORY
devices = list(available_devices())
with st.form("settings_form"):
    c = st.columns(3)
    model = c[0].selectbox("Model", [*models, LOCAL_DIRECTORY], index=[*models, LOCAL_DIRECTORY].index(current_model), key="settings_model")
    model_path = c[0].text_input("Model directory (for a local directory)", value="" if current_model != LOCAL_DIRECTORY else config.model, key="settings_model_path")
    # No bounds on the number boxes: out-of-range values reach the checks below and are refused with the
    # reason (a bounded box would show them red and submit the previous value instead).
    num_blocks = c[1].number_input("Pool size (blocks)", value=engine.num_blocks, step=1, key="settings_num_blocks",
                                   help=f"1 to {MAX_NUM_BLOCKS:,}")  # fmt: skip
    block_size = c[1].number_input("Block size (tokens)", value=config.block_size, step=1, key="settings_block_size",
                                   help=f"1 to {MAX_BLOCK_SIZE}")  # fmt: skip
    dtype = c[2].selectbox("Dtype", DTYPES, index=DTYPES.index(config.dtype), key="settings_dtype")
    policies = [policy.value for policy in EvictionPolicyName]
    eviction = c[1].selectbox(
        "Eviction policy", policies, index=policies.index(config.eviction_policy.value), key="settings_eviction",
        help="lru: least recently used first; reuse-lru: blocks that were reused get more time (engine/core/eviction.py)",
    )
    device = c[2].selectbox("Device", devices, index=devices.index(config.device) if config.device in devices else 0, key="settings_device")
    with st.expander("Scheduler"):
        c = st.columns(3)
        max_batched = c[0].number_input("Max batched tokens per step", value=config.max_num_batched_tokens, key="settings_max_batched")
        max_seqs = c[1].number_input("Max running requests", value=config.max_num_seqs, key="settings_max_seqs")
        seed = c[2].number_input("Seed", value=config.seed, key="settings_seed")
    with st.expander("Sliding-window attention"):
        c = st.columns(3)
        layout_now, _, window_now = (config.attention_override or "").partition(":")
        layout = c[0].selectbox(
            "Attention layout", LAYOUTS, index=LAYOUTS.index(layout_now) if layout_now in LAYOUTS else 0,
            format_func=LAYOUT_LABELS.get, key="settings_layout",
        )
        window = c[0].number_input("Window (tokens)", value=int(window_now or 64), key="settings_window")
        backtrack = c[1].number_input(
            "Window backtrack (tokens)", value=config.window_backtrack, key="settings_backtrack",
            help="Extra tokens of window state kept when caching",
        )
        approximate = c[2].checkbox("Allow approximate replay", config.allow_approximate_replay, key="settings_approximate")
        verify = c[2].checkbox("Verify approximate replays", config.verify_replay, key="settings_verify")
    with st.expander("Disk KV tier", expanded=config.offload_dir is not None):
        c = st.columns([3, 1])
        offload_dir = c[0].text_input(
            "Directory (blank: no disk tier)", value="" if config.offload_dir is None else str(config.offload_dir),
            key="settings_offload_dir",
            help="Evicted full blocks are written here and read back on a hit; a restart on the same directory "
            "with the same model starts warm. Made if missing; it must be writable.",
        )
        offload_gib = c[1].number_input("Size (GiB)", value=float(config.offload_gib or 1.0), step=0.5, format="%g", key="settings_offload_gib",
                                        help=f"More than 0, at most {MAX_CONSOLE_OFFLOAD_GIB:,}; the disk must have the room")  # fmt: skip
    asked = st.form_submit_button("Restart with these settings…")

if asked:
    try:
        name = model_path.strip() if model == LOCAL_DIRECTORY else model
        if not name:
            raise ValueError("give the model directory")
        if not 0 <= seed <= 2**31 - 1:
            raise ValueError(f"seed must be in [0, {2**31 - 1}], got {seed}")
        if layout and not 1 <= window <= MAX_BATCHED_TOKENS:
            raise ValueError(f"the window must be in [1, {MAX_BATCHED_TOKENS}] tokens, got {window}")
        offload = check_offload(offload_dir, float(offload_gib))
        new = dataclasses.replace(  # fields this form does not show keep their running values
            config,
            model=name,
            device=device,
            dtype=dtype,
            block_size=int(block_size),
            num_blocks=int(num_blocks),
            eviction_policy=EvictionPolicyName(eviction),
            kv_memory_mb=None,
            max_num_batched_tokens=int(max_batched),
            max_num_seqs=int(max_seqs),
            seed=int(seed),
            attention_override=None if not layout else f"{layout}:{int(window)}",
            window_backtrack=int(backtrack),
            allow_approximate_replay=approximate,
            verify_replay=verify,
            offload_dir=None if offload is None else offload[0],
            offload_gib=None if offload is None else offload[1],
        )
        per_block = new_bytes_per_block(new)
        if per_block is not None and resolve_device(device).type == "cpu":
            check_pool_fits(new.num_blocks, per_block, machine_memory_bytes())
    except ValueError as exc:
        state.pop("settings_confirm", None)  # a confirmation of earlier settings must not stay under the refusal
        state.pop("settings_pending", None)
        st.error(f"Not restarted: {exc}")
    else:
        state["settings_confirm"] = "restart"
        state["settings_pending"] = new

if state.get("settings_confirm") == "restart" and "settings_pending" in state:
    new = state["settings_pending"]
    per_block = new_bytes_per_block(new)
    needed = None if per_block is None else pool_bytes(new.num_blocks, per_block)
    st.warning(
        f"Restart the shared engine as **{new.model}**, {new.num_blocks:,} blocks × {new.block_size} tokens, "
        f"{new.dtype} on {new.device}, {new.eviction_policy.value} eviction, attention "
        + (LAYOUT_LABELS[""] if new.attention_override is None else
           f"{LAYOUT_LABELS[new.attention_override.partition(':')[0]]} ({new.attention_override.partition(':')[2]}-token window, "
           f"backtrack {new.window_backtrack})")  # fmt: skip
        + (f" (about {needed / 2**20:,.0f} MiB of KV)" if needed is not None else "")
        + (", no disk tier" if new.offload_dir is None else f", a {new.offload_gib:g} GiB disk tier in `{new.offload_dir}`")
        + "? For every operator: unfinished requests end aborted, retained ones are released and the cache "
        + ("starts empty." if new.offload_dir is None else "pool starts empty (the disk tier's files keep their blocks for the same model).")
    )
    c = st.columns([1, 1, 4])
    if c[0].button("Confirm restart", type="primary", key="settings_restart_confirm"):
        state.pop("settings_confirm")
        state.pop("settings_pending")
        try:
            with st.spinner("Loading the model and restarting the engine…"):
                restarted = host.restart(new)
        except Exception as exc:  # the old engine keeps serving; say why the new one did not start
            flash("error", f"Restart failed, the previous engine keeps running: {exc}")
        else:
            expect_in_history(host, f"the new run {restarted.run_id}")
            flash("success", f"Engine restarted: run {restarted.run_id}, {restarted.engine.num_blocks:,} blocks.")
        st.rerun()
    if c[1].button("Cancel", key="settings_restart_cancel"):
        state.pop("settings_confirm")
        state.pop("settings_pending")
        st.rerun()
