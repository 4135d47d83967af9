"""Capacity planner: how much cache a workload needs, under which policy, how far from the optimum, and why
it misses. The analysis runs on a background thread of this session (app/planner.py); a fragment polls it."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis.own_workloads import history_trace
from analysis.policies import Policy
from analysis.purchase import Accelerator, purchase
from analysis.readers import load_trace
from analysis.samples import SAMPLES
from analysis.tier_plan import DEFAULT_DISK_GBPS, MAX_DISK_GBPS, MIN_DISK_GBPS, DiskModel, answer
from analysis.timed import MAX_RATE_TOKENS_PER_S, MIN_RATE_TOKENS_PER_S, ServiceModel
from analysis.trace import TraceFormat
from app.hosting import get_host
from app.planner import (
    MAX_UPLOAD_BYTES, REASONS, SERVED_DTYPE, JobState, PlannerJob, PlannerRequest, curve_frame, engine_tier_point,
    purchase_frame, read_upload, served_shape, tier_frame,
)  # fmt: skip
from app.planner_charts import hit_ratio_curves, tier_curves
from app.ui import kept, read_history, wait_for_history
from engine.core.config import MAX_OFFLOAD_GIB
from engine.core.kv_memory import DTYPE_BYTES
from storage.read import queries

SOURCES = ("Sample", "Upload", "This console's history")
DETECT = "detect from the first line"
THIS_MODEL = "this console's model"
NAMED_MODEL = "a model I describe"
POLL_S = 0.5
PRICE_COLUMN = "price per hour (your figure, your currency)"  # the planner knows no prices or currencies

host = get_host()
console = host.console
state = st.session_state
engine_tokens = console.engine.num_blocks * console.config.block_size

st.title("Capacity planner")
st.caption(
    "What hit ratio a prefix cache of each size would give on a workload, under each eviction policy, how far "
    "that is from the offline optimum (OPT) and from the workload's maximum (an infinite cache), and why the "
    "rest misses. Requests are served one at a time (the sequential mode of `python -m cli analyze`)."
)

# ---------------------------------------------------------------- what to analyse
c = st.columns([1, 2])
source = c[0].radio("Trace", SOURCES, **kept("planner_source", SOURCES[0]))
load = None  # a function the job's thread calls to read the trace
block_size = None
if source == "Sample":
    label = c[1].selectbox("Sample", list(SAMPLES), **kept("planner_sample", next(iter(SAMPLES))))
    path = SAMPLES[label]

    def load():
        return load_trace(path)

elif source == "Upload":
    trace_format = c[1].selectbox(
        "Format", [DETECT, *(f.value for f in TraceFormat if f.value != "history")], **kept("planner_format", DETECT)
    )
    upload = c[1].file_uploader(
        f"A Mooncake or Qwen-Bailian trace (JSON lines, at most {MAX_UPLOAD_BYTES // 2**20} MiB)",
        type=["jsonl", "json", "txt"],
        key="planner_upload",
    )
    upload_id = None if upload is None else upload.file_id
    if state.get("planner_upload_id") != upload_id:  # a new file: the previous file's outcome is not this one's
        state["planner_upload_id"] = upload_id
        job = state.pop("planner_job", None)
        if job is not None:
            job.cancel()
    if upload is not None:
        if upload.size > MAX_UPLOAD_BYTES:
            c[1].error(f"{upload.name} has {upload.size / 2**20:.1f} MiB; the planner takes at most "
                       f"{MAX_UPLOAD_BYTES // 2**20} MiB")  # fmt: skip
        else:
            data = upload.getvalue()
            chosen_format = None if trace_format == DETECT else TraceFormat(trace_format)

            def load():
                return read_upload(data, chosen_format)

else:
    wait_for_history(host)  # the requests this operator just ran are stored before the page reads them
    runs = read_history(queries.runs, host.db, limit=500)
    if runs is not None and not runs.empty:
        labels = {run.id: f"{run.id} · {run.model} · {run.num_blocks}×{run.block_size}" for run in runs.itertuples()}
        chosen = c[1].multiselect("Runs (none: every run)", list(labels), format_func=labels.get, key="planner_runs")
        sizes = sorted({int(size) for size in runs["block_size"]})
        block_size = c[1].selectbox("Block size (the runs')", sizes, key="planner_history_block_size")
        db, picked, history_block_size = host.db, tuple(chosen), block_size

        def load():
            return history_trace(queries.prompt_chains(db, picked).to_dict("records"), history_block_size)

    else:
        c[1].info("The history has no runs yet.")

c = st.columns([1, 2, 1])
if source != "This console's history":
    split = c[0].number_input(
        "Block size (tokens; 0: the trace's own)", 0, 4096, **kept("planner_block_size", console.config.block_size),
        help="Split each block of a hash-id trace into blocks of this size (it must divide the trace's); "
        "the engine's block size to start with, so prefixes are reused in the blocks this engine uses",
    )  # fmt: skip
    block_size = int(split) or None
policies = c[1].multiselect(
    "Policies", [p.value for p in Policy], **kept("planner_policies", ["lru", "reuse-lru", "opt"]),
    help="lru and reuse-lru run through the engine's own block pool; opt is the offline optimum",
)  # fmt: skip
c[2].write("")
start = c[2].button("Analyse", type="primary", key="planner_start", disabled=load is None or not policies)

if start and load is not None:
    previous = state.get("planner_job")
    if previous is not None:
        previous.cancel()
    request = PlannerRequest(block_size, tuple(Policy(p) for p in policies), engine_tokens)
    state["planner_job"] = job = PlannerJob(load, request)
    state["planner_serial"] = state.get("planner_serial", 0) + 1  # the result's widgets are new ones
    job.start()

job: PlannerJob | None = state.get("planner_job")


# ---------------------------------------------------------------- progress (polled while it runs)
@st.fragment(run_every=POLL_S)
def progress_panel() -> None:
    snapshot = job.snapshot()  # type: ignore[union-attr]
    if snapshot.state is not JobState.RUNNING:
        st.rerun()  # draw the result with the whole page
    progress = snapshot.progress
    share = progress.done / progress.total if progress is not None and progress.total else 0.0
    st.progress(share, text=f"Analysing… {progress.stage if progress else 'reading the trace'}")
    if st.button("Cancel", key="planner_cancel"):
        job.cancel()  # type: ignore[union-attr]


if job is None:
    st.info("Choose a trace and press **Analyse**.")
    st.stop()
snapshot = job.snapshot()
if snapshot.state is JobState.RUNNING:
    progress_panel()
    st.stop()
if snapshot.state is JobState.CANCELLED:
    st.warning("The analysis was cancelled.")
    st.stop()
if snapshot.state is JobState.FAILED:
    st.error(f"The trace could not be analysed: {snapshot.error}")
    st.stop()

# ---------------------------------------------------------------- results
result = snapshot.result
analysis = result.analysis
trace = analysis.trace
points = curve_frame(result)
engine_points = points[points["capacity_tokens"] == result.engine_capacity_tokens].set_index("policy")

c = st.columns(5)
c[0].metric("Requests", f"{len(trace):,}")
c[1].metric("Prompt tokens", f"{trace.input_tokens:,}")
c[2].metric("Unique blocks", f"{trace.unique_blocks:,}", help=f"{trace.block_size} tokens per block")
c[3].metric("Maximum hit ratio", f"{analysis.max_hit_ratio:.1%}", help="An infinite cache: no policy does better")
c[4].metric(
    "LRU at this engine's size", f"{engine_points.loc['lru', 'hit_ratio']:.1%}",
    help=f"{result.engine_capacity_tokens:,} tokens: {console.engine.num_blocks:,} blocks × {console.config.block_size}",
)  # fmt: skip

st.subheader("Hit ratio by cache size")
if trace.block_size != console.config.block_size:
    st.caption(
        f"This trace's blocks hold {trace.block_size} tokens, the engine's {console.config.block_size}: prefixes are "
        f"reused in whole blocks, so set the block size above to {console.config.block_size} (if it divides "
        f"{trace.block_size}) to compare like with like."
    )
st.plotly_chart(
    hit_ratio_curves(result.lru, points, analysis.max_hit_ratio, result.engine_capacity_tokens),
    key="planner_chart",
)
st.download_button(
    "Download the curve (CSV)", points.to_csv(index=False), file_name="capacity_curve.csv", mime="text/csv",
    key="planner_csv",
)  # fmt: skip

st.subheader("Capacity LRU needs")
needed = result.needed.copy()
needed["share of the maximum"] = [f"{share:.0%}" for share in needed.pop("share_of_max")]
needed["hit ratio"] = [f"{ratio:.1%}" for ratio in needed.pop("hit_ratio")]
needed["capacity (tokens)"] = [f"{tokens:,}" for tokens in needed.pop("capacity_tokens")]
st.table(needed.set_index("share of the maximum"))

# ---------------------------------------------------------------- what to buy
st.subheader("What to buy")
st.caption(
    "Each capacity above in GiB of KV (2 × layers × KV heads × head size × dtype bytes per token), in "
    "accelerators that each hold a copy of the weights and give the rest of their usable memory to KV, and in "
    "money per hour."
)
loaded = console.engine.loaded
c = st.columns([2, 1, 1, 1, 1, 1])
model_source = c[0].radio("Model", [THIS_MODEL, NAMED_MODEL], **kept("planner_model_source", THIS_MODEL))
dtype = c[1].selectbox(
    "Served dtype", list(DTYPE_BYTES), **kept("planner_dtype", SERVED_DTYPE),
    help=f"What the deployment stores its weights and KV in: {SERVED_DTYPE} to start with, as a GPU server runs "
    f"(this console runs {console.config.dtype})",
)  # fmt: skip
if model_source == THIS_MODEL:
    shape_values = (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.num_parameters)
    c[0].caption(
        f"{loaded.model_id}: {loaded.num_layers} layers, {loaded.num_kv_heads} KV heads of {loaded.head_dim}, "
        f"{shape_values[3] / 1e6:,.0f} M parameters"
    )
else:
    layers = c[2].number_input("Layers", 1, 1024, **kept("planner_layers", 32))
    kv_heads = c[3].number_input("KV heads", 1, 1024, **kept("planner_kv_heads", 8))
    head_size = c[4].number_input("Head size", 1, 4096, **kept("planner_head_size", 128))
    weights_b = c[5].number_input("Parameters (billions)", 0.0, 10_000.0, step=0.1, **kept("planner_params_b", 8.0))
    shape_values = (int(layers), int(kv_heads), int(head_size), int(weights_b * 1e9))
c = st.columns([2, 1, 1, 1, 2])
memory_gib = c[1].number_input("Accelerator memory (GiB)", 1.0, 4096.0, step=8.0, **kept("planner_memory_gib", 80.0))
usable = c[2].number_input("Usable share", 0.05, 1.0, step=0.05, **kept("planner_usable", 0.9),
                           help="What the server may use of it (vLLM's gpu_memory_utilization)")  # fmt: skip
price = c[3].number_input(
    "Price per accelerator-hour", 0.0, 10_000.0, step=0.5, **kept("planner_price", 2.5),
    help="Your own figure, in your own currency: the console knows no prices and assumes no currency; it "
    "multiplies this by the accelerators each capacity needs",
)
shape = served_shape(*shape_values, DTYPE_BYTES[dtype])  # bounded by the inputs above
accelerator = Accelerator(float(memory_gib), float(usable), float(price))
try:
    bought = purchase_frame(result.needed, result.engine_capacity_tokens, shape, accelerator)
except ValueError as error:
    st.error(f"Cannot price it: {error}")
else:
    c[0].metric("KV per token", f"{shape.kv_bytes_per_token:,} bytes", help=f"in {dtype}")
    st.caption(f"Priced in {dtype}: {shape.kv_bytes_per_token:,} bytes of KV a token, "
               f"{shape.weight_bytes / 2**30:.2f} GiB of weights on each accelerator.")  # fmt: skip
    st.table(
        pd.DataFrame(
            {
                "target": bought["target"],
                "hit ratio": [f"{engine_points.loc['lru', 'hit_ratio'] if pd.isna(r) else r:.1%}" for r in bought["hit_ratio"]],
                "capacity (tokens)": [f"{t:,}" for t in bought["capacity_tokens"]],
                "KV (GiB)": [f"{g:,.2f}" for g in bought["kv_gib"]],
                "accelerators": bought["accelerators"],
                PRICE_COLUMN: [f"{p:,.2f}" for p in bought["price_per_hour"]],
            }
        ).set_index("target")
    )

# ---------------------------------------------------------------- a disk tier
st.subheader("A disk tier behind the pool")
st.caption(
    "An LRU disk tier that takes the pool's evicted blocks and promotes them back on a hit (the engine's "
    "`--offload-dir`/`--offload-gib`). A pool of P blocks with a tier of D that gives up what it promotes hits what "
    "one pool of P + D hits; this engine's tier keeps a copy of what it promotes, so it hits at least what a pool "
    "of the larger of the two hits (the dotted line). Each block the tier serves is read at the disk's bandwidth "
    f"before the prefill; each token it serves is a prompt token not computed. Blocks weigh {shape.kv_bytes_per_token:,} "
    f"bytes a token ({dtype}, the model above)."
)
c = st.columns(3)
tier_gib = c[0].number_input("Disk tier (GiB)", 0.0, float(MAX_OFFLOAD_GIB), step=8.0, **kept("planner_tier_gib", 32.0))
disk_gbps = c[1].number_input(
    "Disk read bandwidth (GB/s)", MIN_DISK_GBPS, MAX_DISK_GBPS, step=0.5, **kept("planner_disk_gbps", DEFAULT_DISK_GBPS),
    help=f"{DEFAULT_DISK_GBPS:g} GB/s to start with, a local NVMe SSD's read (a stated figure, not measured): your disk's",
)  # fmt: skip
prefill_rate = c[2].number_input(
    "Prefill (tokens/s)", MIN_RATE_TOKENS_PER_S, MAX_RATE_TOKENS_PER_S, step=10.0,
    **kept("planner_prefill_rate", ServiceModel().prefill_tokens_per_s),
    help="What one second of prefill computes: measured on this engine (benchmarks/service_rates.py) to start with",
)  # fmt: skip
disk = DiskModel(shape.kv_bytes_per_token, float(disk_gbps))
tier_point = engine_tier_point(result, float(tier_gib), disk, float(prefill_rate))
st.plotly_chart(
    tier_curves(tier_frame(result, float(tier_gib), disk), float(tier_gib), analysis.max_hit_ratio,
                result.engine_capacity_tokens),
    key="planner_tier_chart",
)  # fmt: skip
st.markdown(f"**This engine's pool:** {answer(tier_point)}.")
try:
    alone = purchase(tier_point.pool_alone_tokens, shape, accelerator)
except ValueError:
    alone = None  # the purchase section above says why it cannot price
if alone is not None:
    st.caption(
        f"Without a tier, a pool of {alone.capacity_tokens:,} tokens hits as much: {alone.kv_gib:,.2f} GiB of KV, "
        f"{alone.accelerators:,} accelerator(s), {alone.price_per_hour:,.2f} an hour at your price."
    )

st.subheader("Why it misses")
labels = {i: f"{p.policy.value} at {p.capacity_tokens:,} tokens" for i, p in enumerate(analysis.curve)}
default = next(
    i for i, p in enumerate(analysis.curve) if p.policy is Policy.LRU and p.capacity_tokens == result.engine_capacity_tokens
)
chosen = st.selectbox(  # a key per analysis: a kept index would name another result's point
    "Point", list(labels), format_func=labels.get, index=default, key=f"planner_point_{state.get('planner_serial', 0)}"
)
point = analysis.curve[chosen]
breakdown = {"hit": point.hit_tokens, **{reason: getattr(point.misses, reason) for reason in REASONS}}
c = st.columns([1, 2])
c[0].table({"tokens": {name: f"{tokens:,}" for name, tokens in breakdown.items()}})
c[1].bar_chart({"tokens": breakdown}, horizontal=True)
st.caption(
    "compulsory: first time the prefix was seen · capacity: seen, but evicted before this reuse · partial: "
    "past the last full block (never cached) · namespace: the same tokens cached under another model, dtype "
    "or tenant salt · pinned: the timed mode only (running requests held the pool)."
)

st.subheader("Hot prefixes")
prefixes = point.top_prefixes or analysis.max_top_prefixes
st.caption("The hit chains that saved the most prompt tokens at this point" + (
    "" if point.top_prefixes else " (none hit here: these are the infinite cache's)"))  # fmt: skip
st.dataframe(
    [
        {"first block": p.first_block, "last block": p.last_block, "blocks": p.depth, "requests": p.requests,
         "tokens saved": p.tokens_saved}
        for p in prefixes
    ],  # fmt: skip
    hide_index=True,
)
