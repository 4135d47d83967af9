"""Capacity planner page: a sample, an upload and the console's own history analysed on a background thread,
the curve, the capacity needed, the breakdown, the hot prefixes and the CSV; bad uploads are refused."""

from __future__ import annotations

import json

import pytest

from analysis.errors import TraceError
from analysis.tier_plan import DiskModel, answer
from analysis.timed import ServiceModel
from app.planner import (
    MAX_UPLOAD_BYTES, JobState, PlannerJob, PlannerRequest, curve_frame, engine_tier_point, plan, read_upload,
    served_shape, tier_frame,
)  # fmt: skip
from engine.core.config import MAX_OFFLOAD_GIB
from analysis.policies import Policy
from analysis.readers import load_trace
from engine.core.request import SamplingParams
from tests.analysis_support import BAILIAN_SAMPLE, CONVERSATION_SAMPLE
from tests.test_app_support import (  # noqa: F401
    console_env,
    flush_history,
    host,
    no_exceptions,
    open_page,
    texts,
    wait_for,
    wait_idle,
)


def analysed(at):
    """Press Analyse, wait for this session's job, rerun: the page then shows the result."""
    at.button(key="planner_start").click().run()
    job = at.session_state["planner_job"]
    assert job.join(timeout_s=120), "the analysis did not finish"
    return at.run()


def test_a_sample_is_analysed_in_the_background_and_every_panel_is_drawn(console_env):
    at = open_page("capacity_planner")
    no_exceptions(at)
    assert "Choose a trace and press **Analyse**." in texts(at)
    at = analysed(at)
    no_exceptions(at)
    assert at.session_state["planner_job"].snapshot().state is JobState.DONE
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Requests"] == "223" and metrics["Maximum hit ratio"] == "37.9%"
    assert metrics["LRU at this engine's size"].endswith("%")
    assert [s.value for s in at.subheader] == [
        "Hit ratio by cache size", "Capacity LRU needs", "What to buy", "A disk tier behind the pool", "Why it misses",
        "Hot prefixes",
    ]  # fmt: skip
    needed = at.table[0].value
    assert list(needed.index) == ["50%", "80%", "90%", "95%"]
    assert at.get("plotly_chart") and at.get("download_button")


def test_the_chosen_point_shows_its_breakdown_summing_to_the_prompt_tokens(console_env):
    at = analysed(open_page("capacity_planner"))
    points = at.selectbox(key="planner_point_1")
    engine = host().console.engine
    engine_tokens = engine.num_blocks * engine.config.block_size  # 64 blocks of 16: the default point
    assert points.format_func(points.value) == f"lru at {engine_tokens:,} tokens"
    breakdown = at.table[2].value["tokens"]
    total = sum(int(value.replace(",", "")) for value in breakdown)
    assert total == load_trace(CONVERSATION_SAMPLE).input_tokens


def test_an_upload_is_checked_and_a_bad_line_is_reported_with_its_number(console_env):
    at = open_page("capacity_planner")
    at.radio(key="planner_source").set_value("Upload").run()
    at.file_uploader(key="planner_upload").set_value(("bailian.jsonl", BAILIAN_SAMPLE.read_bytes(), "application/jsonl")).run()
    at = analysed(at)
    no_exceptions(at)
    assert {m.label: m.value for m in at.metric}["Requests"] == "8"

    broken = BAILIAN_SAMPLE.read_bytes() + b'{"chat_id": 9, "timestamp"\n'
    at.file_uploader(key="planner_upload").set_value(("broken.jsonl", broken, "application/jsonl")).run()
    assert not at.error, "a new file's page shows no outcome of the previous one"
    at = analysed(at)
    assert [e.value for e in at.error][0].startswith("The trace could not be analysed: line 9: not valid JSON")

    unknown = b'{"id": 1, "tokens": [1, 2]}\n'
    at.file_uploader(key="planner_upload").set_value(("unknown.jsonl", unknown, "application/jsonl")).run()
    assert not at.error, "the previous upload's error is gone with its file"
    at = analysed(at)
    assert [e.value for e in at.error] == [
        "The trace could not be analysed: line 1: cannot tell the trace format (no hash_ids or chat_id field): "
        "choose it under Format"
    ]


def test_this_consoles_history_is_analysed_from_its_stored_prompt_keys(console_env):
    engine = host().console.engine
    prompt = list(range(100, 160))
    for _ in range(3):
        engine.submit(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        wait_idle()
    flush_history()
    at = open_page("capacity_planner")
    at.radio(key="planner_source").set_value("This console's history").run()
    at = analysed(at)
    no_exceptions(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Requests"] == "3" and metrics["Maximum hit ratio"] == "53.3%"  # two repeats hit 3 full blocks: 96 of 180


def test_uploads_are_bounded_and_read_like_files():
    assert len(read_upload(BAILIAN_SAMPLE.read_bytes())) == 8
    with pytest.raises(TraceError, match="at most 16 MiB"):
        read_upload(b"\n" * (MAX_UPLOAD_BYTES + 1))
    with pytest.raises(TraceError, match="the trace is empty"):
        read_upload(b"")


def test_a_job_can_be_cancelled_and_says_so():
    def slow_load():
        return load_trace(CONVERSATION_SAMPLE).split(16)

    job = PlannerJob(slow_load, PlannerRequest(None, (Policy.LRU, Policy.FIFO, Policy.LFU), 16384))
    job.cancel()  # before the first progress tick: it stops there
    job.start()
    assert job.join(timeout_s=120)
    assert job.snapshot().state is JobState.CANCELLED and job.snapshot().result is None


def test_the_csv_has_one_row_per_point_with_every_miss_reason():
    result = plan(load_trace(CONVERSATION_SAMPLE), PlannerRequest(None, (Policy.OPT,), 16384))
    frame = curve_frame(result)
    assert set(frame["policy"]) == {"lru", "opt"}
    assert (frame["hit_tokens"] + frame.filter(like="missed_").sum(axis=1) == result.analysis.trace.input_tokens).all()
    assert json.loads(frame.to_json(orient="records"))[0]["policy"] == "lru"


def test_a_new_analysis_starts_at_its_own_engine_point_and_not_the_previous_results_index(console_env):
    at = open_page("capacity_planner")
    at.number_input(key="planner_block_size").set_value(0).run()
    at = analysed(at)
    at.number_input(key="planner_block_size").set_value(16).run()
    at = analysed(at)
    engine = host().console.engine
    engine_tokens = engine.num_blocks * engine.config.block_size
    points = at.selectbox(key="planner_point_2")
    point = at.session_state["planner_job"].snapshot().result.analysis.curve[points.value]
    assert points.format_func(points.value) == f"lru at {engine_tokens:,} tokens" == f"lru at {point.capacity_tokens:,} tokens"
    assert at.table[2].value["tokens"]["hit"] == f"{point.hit_tokens:,}"


def test_the_purchase_table_prices_each_capacity_for_this_model_or_a_described_one(console_env):
    at = analysed(open_page("capacity_planner"))
    bought = at.table[1].value
    assert list(bought.index) == ["this engine's pool", "50% of the maximum", "80% of the maximum",
                                  "90% of the maximum", "95% of the maximum"]  # fmt: skip
    # Regression (issue 47, item 15): the price named no currency; it is the operator's own figure.
    assert list(bought.columns) == ["hit ratio", "capacity (tokens)", "KV (GiB)", "accelerators",
                                    "price per hour (your figure, your currency)"]  # fmt: skip
    price = at.number_input(key="planner_price")
    assert price.label == "Price per accelerator-hour" and "in your own currency" in price.help
    at.radio(key="planner_model_source").set_value("a model I describe").run()
    at.number_input(key="planner_memory_gib").set_value(16.0).run()  # 8 B parameters in bfloat16 do not fit
    assert [e.value for e in at.error][0].startswith("Cannot price it: the weights (14.9 GiB) fill the usable 14.4 GiB")


def test_what_to_buy_prices_the_served_dtype_bfloat16_by_default_and_says_so(console_env):
    """Regression (issue 47 item 14c): the purchase priced the console's own float32 KV, twice the bytes a
    bfloat16 or float16 deployment stores."""
    at = analysed(open_page("capacity_planner"))
    loaded = host().console.engine.loaded
    assert host().console.config.dtype == "float32"  # what the console itself runs
    bf16_bytes = 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * 2
    assert at.selectbox(key="planner_dtype").value == "bfloat16"
    assert {m.label: m.value for m in at.metric}["KV per token"] == f"{bf16_bytes:,} bytes"
    assert any(c.value.startswith(f"Priced in bfloat16: {bf16_bytes:,} bytes of KV a token") for c in at.caption)
    at.selectbox(key="planner_dtype").select("float32").run()
    assert {m.label: m.value for m in at.metric}["KV per token"] == f"{2 * bf16_bytes:,} bytes"
    assert any(c.value.startswith("Priced in float32") for c in at.caption)


def tier_answer(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**This engine's pool:**"))


def test_a_disk_tier_behind_this_engines_pool_is_answered_off_the_curve_and_bounded(console_env):
    at = analysed(open_page("capacity_planner"))
    result = at.session_state["planner_job"].snapshot().result
    loaded = host().console.engine.loaded
    shape = served_shape(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.num_parameters, 2)  # bfloat16
    expected = engine_tier_point(result, 32.0, DiskModel(shape.kv_bytes_per_token, 2.0), ServiceModel().prefill_tokens_per_s)
    assert tier_answer(at) == f"**This engine's pool:** {answer(expected)}."
    assert "add 32 GiB of disk tier" in tier_answer(at)
    assert expected.hit_tokens >= expected.pool_hit_tokens
    assert len(at.get("plotly_chart")) == 2
    at.number_input(key="planner_tier_gib").set_value(0.0).run()
    none = engine_tier_point(result, 0.0, DiskModel(shape.kv_bytes_per_token, 2.0), ServiceModel().prefill_tokens_per_s)
    assert none.hit_tokens == none.pool_hit_tokens and none.loaded_blocks == 0
    assert f"hit ratio {none.ratio(none.pool_hit_tokens):.3f} -> {none.ratio(none.pool_hit_tokens):.3f}" in tier_answer(at)
    assert at.number_input(key="planner_tier_gib").max == float(MAX_OFFLOAD_GIB)


def test_the_tier_frame_lies_between_the_pool_alone_and_the_maximum():
    result = plan(load_trace(CONVERSATION_SAMPLE), PlannerRequest(None, (), 16384))
    frame = tier_frame(result, 1.0, DiskModel(46_080))
    assert (frame["pool_alone"] <= frame["floor"]).all() and (frame["floor"] <= frame["with_tier"]).all()
    assert (frame["with_tier"] <= result.analysis.max_hit_ratio + 1e-12).all()
    assert frame["with_tier"].iloc[0] > frame["pool_alone"].iloc[0]  # a 1-block pool gains from a 1 GiB tier
