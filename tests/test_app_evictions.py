"""Evictions page: the persisted log after forced evictions, its filters, pages and runs."""

from __future__ import annotations

import subprocess
import sys
import time

from sqlalchemy import insert

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from storage import migrate
from storage.db import db_engine
from storage.read import queries
from storage.schema import REQUESTS, RUNS
from storage.write.run_liveness import this_host
from tests.test_app_support import (  # noqa: F401
    console_env,
    errors,
    flush_history,
    host,
    no_exceptions,
    open_page,
    texts,
    wait_idle,
)
from tests.storage_support import RUN_INFO

PARAMS = SamplingParams(max_new_tokens=2, ignore_eos=True)


def log_rows(at):
    return next(d.value for d in at.dataframe if "reason" in d.value.columns)


def test_a_forced_eviction_shows_in_the_log(console_env):
    console_env(num_blocks=8)
    engine = host().console.engine
    engine.submit(list(range(10, 58)), PARAMS)  # 3 full blocks stay cached
    wait_idle()
    engine.submit(list(range(100, 196)), PARAMS)  # needs 7 of the 8 blocks: evicts cached ones
    wait_idle()
    assert engine.stats().evictions >= 2
    flush_history()
    at = open_page("evictions")
    no_exceptions(at)
    rows = log_rows(at)
    assert len(rows) == engine.stats().evictions
    assert set(rows["reason"]) <= {"lru", "parent_evicted"} and "lru" in set(rows["reason"])
    assert set(rows["run_id"]) == {host().console.run_id}
    assert f"{len(rows)} evictions" in [h.value for h in at.subheader]
    assert not at.get("download_button")[0].proto.disabled


def fill_and_reset(num_prompts: int) -> int:
    """Cache 3 blocks per prompt, then reset: one 'reset' eviction per cached block."""
    engine = host().console.engine
    for i in range(num_prompts):
        engine.submit([10 + i] + list(range(1000, 1047)), PARAMS)
    wait_idle()
    dropped = engine.reset_cache().dropped_blocks
    flush_history()
    return dropped


def test_pages_walk_the_log_with_keyset_cursors(console_env):
    assert fill_and_reset(10) == 30
    at = open_page("evictions")
    at.selectbox(key="evict_page_size").select(25).run()
    first = log_rows(at)
    assert len(first) == 25 and "Rows 1–25, newest first" in texts(at)
    assert at.button(key="evict_newer").disabled
    at.button(key="evict_older").click().run()
    second = log_rows(at)
    assert len(second) == 5 and "Rows 26–30, newest first" in texts(at)
    assert at.button(key="evict_older").disabled
    assert set(first["id"]).isdisjoint(second["id"])
    at.button(key="evict_newer").click().run()
    assert list(log_rows(at)["id"]) == list(first["id"])


def test_filters_narrow_the_log_and_bad_ones_show_an_error(console_env):
    fill_and_reset(2)
    at = open_page("evictions")
    assert "6 evictions" in [h.value for h in at.subheader]
    at.multiselect(key="evict_reasons").select("lru").run()
    assert "0 evictions" in [h.value for h in at.subheader]
    at.multiselect(key="evict_reasons").unselect("lru").select("reset").run()
    key = log_rows(at)["key_hex"].iloc[0]
    at.text_input(key="evict_key_prefix").input(key[:6]).run()
    assert list(log_rows(at)["key_hex"]) == [key]
    at.text_input(key="evict_key_prefix").input("xyz").run()
    assert errors(at) == ["Filter not applied: key prefix must be hex digits, got 'xyz'."]
    assert not [d for d in at.dataframe if "reason" in d.value.columns]


def test_earlier_runs_stay_visible_with_a_run_selector(console_env):
    fill_and_reset(1)
    old_run = host().console.run_id
    new = host().restart(EngineConfig(**{**vars(host().console.config), "num_blocks": 32}))
    flush_history()
    at = open_page("evictions")
    options = at.selectbox(key="evict_run").options
    assert len(options) == 3 and "All runs" in options  # all runs, the new run, the old one
    assert "3 evictions" in [h.value for h in at.subheader]  # default: all runs
    at.selectbox(key="evict_run").set_value(new.run_id).run()
    assert "0 evictions" in [h.value for h in at.subheader]
    at.selectbox(key="evict_run").set_value(old_run).run()
    assert "3 evictions" in [h.value for h in at.subheader]
    assert set(log_rows(at)["run_id"]) == {old_run}


def test_a_run_whose_server_was_killed_shows_as_interrupted_after_the_next_start(console_env, tmp_path):
    """A run whose owner died (a pid no longer alive on this host) and its running request are closed when
    the console starts its own run, and the page says so (issue 47 item 7)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    db = db_engine(f"sqlite:///{tmp_path / 'history.sqlite'}")  # the console's database (console_env)
    migrate.upgrade(db)
    now = time.time()  # recent: the console's retention keeps it
    run = {**vars(RUN_INFO), "started_at": now, "id": "crashed-run", "host": this_host(), "pid": int(dead.stdout), "stopped_at": None,
           "end_reason": None, "heartbeat_at": now}  # fmt: skip
    request = {"run_id": "crashed-run", "request_id": "req-0", "status": "running", "prompt_tokens": 3,
               "output_token_ids": [], "cached_tokens": 0, "computed_tokens": 0, "hit_source": "none",
               "cow_copies": 0, "preemptions": 0, "arrival_time": now}  # fmt: skip
    with db.begin() as connection:
        connection.execute(insert(RUNS), [run])
        connection.execute(insert(REQUESTS), [request])
    db.dispose()

    at = open_page("evictions")  # starts the console: its writer's first run closes the dead one
    flush_history()
    at.run()
    no_exceptions(at)
    assert any(w.value.startswith("Run crashed-run interrupted (closed at next start)") for w in at.warning)
    labels = at.selectbox(key="evict_run")
    assert labels.format_func("crashed-run").endswith("(interrupted)")
    requests = queries.recent_requests(host().db, "crashed-run")
    assert requests["status"].tolist() == ["interrupted"]
