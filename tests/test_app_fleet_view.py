"""The plain functions behind the Fleet pages: metrics summaries, the idle-before-eviction histogram, the
prefix tree's rows, and chat messages rendered with a model directory's chat template (issue 31's pages)."""

from __future__ import annotations

import math

import pytest

from app.fleet_prompts import chat_token_ids, local_chat_template, parse_chat_messages
from app.fleet_view import idle_before_evict_frame, metrics_frame, metrics_summary, short_hash, tree_frame
from fleet.events import PodMetrics
from fleet.index import FleetIndex
from tests.fleet_support import pod_batch


def scrape(at: float, queries: float, hits: float, **values) -> PodMetrics:
    fields = {"num_preemptions": 0.0, "kv_cache_usage": 0.25, "num_running": 1.0, "num_waiting": 0.0}
    fields.update(values)
    return PodMetrics("a", at, queries, hits, num_gpu_blocks=128, **fields)


def test_the_windowed_hit_rate_covers_the_last_minute_and_the_lifetime_rate_everything():
    scrapes = [scrape(0, 1000, 900), scrape(30, 1000, 900), scrape(65, 1100, 925), scrape(95, 1200, 950)]
    summary = metrics_summary(scrapes)
    assert summary.lifetime_hit_rate == pytest.approx(950 / 1200)
    assert summary.hit_rate == pytest.approx(50 / 200), "from the scrape at 30 s, a minute before the latest"
    assert (summary.kv_usage, summary.capacity_blocks, summary.error) == (0.25, 128, None)
    idle = metrics_summary([scrape(0, 1000, 900), scrape(60, 1000, 900)])
    assert idle.hit_rate is None and idle.lifetime_hit_rate == pytest.approx(0.9), "idle: no window rate"


def test_a_restarted_servers_counters_start_the_window_again():
    summary = metrics_summary([scrape(0, 5000, 100), scrape(70, 40, 10)])
    assert summary.hit_rate == pytest.approx(10 / 40)


def test_the_metrics_history_has_a_hit_rate_and_preemptions_between_consecutive_scrapes():
    frame = metrics_frame([scrape(0, 100, 50, num_preemptions=2.0), scrape(5, 200, 125, num_preemptions=5.0)])
    assert math.isnan(frame["hit_rate"].iloc[0]) or frame["hit_rate"].iloc[0] is None
    assert frame["hit_rate"].iloc[1] == pytest.approx(0.75) and frame["preemptions"].iloc[1] == 3.0


def test_idle_before_eviction_is_the_difference_of_vllms_cumulative_buckets_over_the_range():
    early = scrape(0, 1, 1, idle_before_evict=((1.0, 2.0), (10.0, 5.0), (math.inf, 5.0)))
    late = scrape(60, 1, 1, idle_before_evict=((1.0, 3.0), (10.0, 9.0), (math.inf, 10.0)))
    frame = idle_before_evict_frame([early, late])
    assert frame["evictions"].tolist() == [1.0, 3.0, 1.0] and frame["bin_end"].tolist() == [1.0, 10.0, math.inf]
    assert idle_before_evict_frame([scrape(0, 1, 1)]).empty


def test_the_prefix_tree_rows_carry_age_idle_time_and_the_tokens_below_each_node():
    from tests.test_fleet_index import stored

    index = FleetIndex()
    index.apply_batch(pod_batch([stored([1, 2, 3], list(range(12)))], ts=100.0))
    index.apply_batch(pod_batch([stored([4], list(range(20, 24)), parent=1)], seq=1, ts=130.0))
    frame = tree_frame(index.prefix_tree(), now=160.0).set_index("depth")
    root = frame.loc[1]
    assert (root["tokens_below"], root["age_s"], root["idle_s"]) == (16, 60.0, 60.0)
    assert sorted(frame["age_s"].tolist()) == [30.0, 60.0, 60.0, 60.0]


def test_hashes_are_shortened_for_tables():
    assert short_hash("12345678901234567890") == "123456…567890" and short_hash("1234") == "1234"


def test_chat_messages_are_read_from_role_lines_or_an_openai_json_array():
    assert parse_chat_messages("system: be brief\nuser: hi\nthere") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi\nthere"},
    ]
    assert parse_chat_messages('[{"role": "user", "content": "x"}]') == [{"role": "user", "content": "x"}]
    for bad in ("", "hello", '[{"role": "wizard", "content": "x"}]', "[1, 2"):
        with pytest.raises(ValueError):
            parse_chat_messages(bad)


def test_chat_messages_render_with_the_model_directorys_chat_template_as_vllm_renders_them(test_data_dir):
    from engine.runner.model_loading import SMOLLM2_TOKENIZER_CACHE_NAME, smollm2_tokenizer

    reference = smollm2_tokenizer(test_data_dir)
    directory = test_data_dir / "models" / SMOLLM2_TOKENIZER_CACHE_NAME
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    ids = chat_token_ids(local_chat_template(str(directory)), messages)
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError):
        local_chat_template(str(test_data_dir / "no-such-model"))
