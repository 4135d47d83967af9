"""Settings page: destructive actions ask first; bad configurations change nothing."""

from __future__ import annotations

import pytest

from engine.core.request import SamplingParams
from tests.test_app_support import console_env, errors, host, no_exceptions, open_page, texts, wait_idle  # noqa: F401

PARAMS = SamplingParams(max_new_tokens=2, ignore_eos=True)


def cache_something() -> None:
    host().console.engine.submit(list(range(10, 60)), PARAMS)  # 3 full blocks stay cached
    wait_idle()


def test_settings_shows_the_running_engine_and_the_database(console_env, tmp_path):
    at = open_page("settings")
    no_exceptions(at)
    table = at.table[0].value
    values = dict(zip(table["setting"], table["value"]))
    assert values["model"] == "tiny-chat" and values["pool"] == "64 blocks × 16 tokens"
    assert values["forward"] == "decoder, fused CPU ops, linears: panels up to 128 rows, oneDNN above"  # a Llama: the forward over its weights (engine/runner/decoder_forward.py)
    assert values["attention kernels"] == "cpu-tiled; masked calls cpu-flash; decodes cpu-paged-decode"
    assert f"SQLite file: `{tmp_path / 'history.sqlite'}`" in texts(at)


def test_reset_asks_for_confirmation_first(console_env):
    cache_something()
    engine = host().console.engine
    at = open_page("settings")
    at.button(key="settings_reset").click().run()
    assert engine.stats().evictable_blocks == 3  # nothing happened yet
    assert "Reset the prefix cache of the shared engine? 3 cached blocks would be evicted." in texts(at)
    at.button(key="settings_reset_cancel").click().run()
    assert engine.stats().evictable_blocks == 3
    assert not at.button(key="settings_reset").disabled

    at.button(key="settings_reset").click().run()
    at.button(key="settings_reset_confirm").click().run()
    no_exceptions(at)
    assert engine.stats().evictable_blocks == 0
    assert "Prefix cache reset: 3 blocks evicted; the cache is empty." in [s.value for s in at.success]


def test_reset_says_honestly_when_held_blocks_stay(console_env):
    engine = host().console.engine
    engine.submit(list(range(10, 60)), PARAMS, retain=True)
    wait_idle()
    at = open_page("settings")
    at.button(key="settings_reset").click().run()
    at.button(key="settings_reset_confirm").click().run()
    assert [w.value for w in at.warning] == [
        "Prefix cache partly reset: 0 blocks evicted, 3 cached blocks kept because running or retained requests hold them."
    ]


def test_restart_asks_for_confirmation_then_starts_a_new_run(console_env):
    old = host().console
    at = open_page("settings")
    at.number_input(key="settings_num_blocks").set_value(32)
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert host().console is old  # nothing happened yet
    assert "Restart the shared engine as **tiny-chat**, 32 blocks × 16 tokens" in texts(at)
    at.button(key="settings_restart_confirm").click().run()
    no_exceptions(at)
    new = host().console
    assert new is not old and new.engine.num_blocks == 32 and new.run_id != old.run_id
    with pytest.raises(ValueError, match="takes no new requests: the engine was restarted; reload the page"):
        old.engine.submit([5, 6, 7], PARAMS)  # a session still holding the old engine is told, not queued
    fresh = new.engine.submit([5, 6, 7], PARAMS)
    wait_idle()
    assert new.engine.get(fresh).status == "finished"
    assert [s.value for s in at.success] == [f"Engine restarted: run {new.run_id}, 32 blocks."]


def test_after_a_restart_request_ids_continue_past_the_previous_runs(console_env):
    """Regression: every engine numbered its ids from req-0, so "All runs" mixed requests of different runs."""
    old = host().console
    assert [old.engine.submit([5, 6, 7], PARAMS) for _ in range(2)] == ["req-0", "req-1"]
    wait_idle()
    at = open_page("settings")
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    at.button(key="settings_restart_confirm").click().run()
    no_exceptions(at)
    new = host().console
    assert new is not old and new.engine.submit([5, 6, 7], PARAMS) == "req-2"


def test_a_new_console_on_the_same_history_continues_its_request_ids(console_env):
    engine = host().console.engine
    assert [engine.submit([5, 6, 7], PARAMS) for _ in range(3)] == ["req-0", "req-1", "req-2"]
    wait_idle()
    console_env()  # the host shuts down (its history written) and a new one starts on the same database
    assert host().console.engine is not engine
    assert host().console.engine.submit([5, 6, 7], PARAMS) == "req-3"


def test_a_bad_configuration_shows_an_error_and_changes_nothing(console_env):
    old = host().console
    at = open_page("settings")
    at.selectbox(key="settings_model").select("local directory…")
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert errors(at) == ["Not restarted: give the model directory"]
    at.text_input(key="settings_model_path").input("/nonexistent/model")
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert not errors(at)
    at.button(key="settings_restart_confirm").click().run()
    assert host().console is old
    assert [e.value for e in at.error][0].startswith("Restart failed, the previous engine keeps running: unknown model")


def test_restart_can_choose_the_eviction_policy(console_env):
    at = open_page("settings")
    values = dict(zip(at.table[0].value["setting"], at.table[0].value["value"]))
    assert values["eviction policy"] == "lru"
    at.selectbox(key="settings_eviction").select("reuse-lru")
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert "reuse-lru eviction" in texts(at)
    at.button(key="settings_restart_confirm").click().run()
    no_exceptions(at)
    engine = host().console.engine
    assert engine.config.eviction_policy == "reuse-lru"
    assert {manager.pool.eviction_policy for manager in engine.kv.managers} == {"reuse-lru"}


def test_a_negative_pool_is_refused_with_the_reason_and_the_confirmation_names_the_attention_layout(console_env):
    """Regression: a bounded box showed -5 red and the restart button did nothing, silently."""
    old = host().console
    at = open_page("settings")
    at.number_input(key="settings_num_blocks").set_value(-5)
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert errors(at) == [f"Not restarted: num_blocks must be in [1, {1 << 20}], got -5"]
    assert host().console is old and not any(b.key == "settings_restart_confirm" for b in at.button)
    at.number_input(key="settings_num_blocks").set_value(32)
    at.selectbox(key="settings_layout").select("sliding")
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    assert "eviction, attention every layer sliding (64-token window, backtrack 0)" in texts(at)


def test_settings_shows_where_the_api_serves_or_that_there_is_none(console_env, monkeypatch):
    """Regression (issue 47, item 15): neither Settings nor the sidebar said where the API was."""
    at = open_page("settings")
    table = at.table[0].value
    assert dict(zip(table["setting"], table["value"]))["OpenAI-compatible API"] == "no API"
    monkeypatch.setattr(type(host()), "api_url", property(lambda self: "http://127.0.0.1:8000"), raising=False)
    at.run()
    table = at.table[0].value
    assert dict(zip(table["setting"], table["value"]))["OpenAI-compatible API"] == "http://127.0.0.1:8000/v1"
