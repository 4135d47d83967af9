"""Console faults: each one is shown where an operator looks, and the engine keeps serving. A listener
that raises, the writer process killed, the history's disk full, an operator's read-your-writes wait (a
page waits for the rows of the action just taken), a request whose logits go NaN, and a restart from
Settings while requests run. The engine-level NaN tests are in tests/test_engine_faults.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from app import ui
from app.hosting import RESTART_REASON
from engine.core.request import SamplingParams
from storage import migrate
from storage.read import queries
from tests.storage_support import fill_disk
from tests.test_app_support import (  # noqa: F401
    PAGES,
    console_env,
    errors,
    flush_history,
    host,
    no_exceptions,
    open_page,
    texts,
    wait_for,
    wait_idle,
)

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=1500, ignore_eos=True)  # runs for seconds: still running at a restart


def warnings_and_errors(at) -> str:
    return "\n".join([w.value for w in at.warning] + [e.value for e in at.error])


def test_a_listener_that_raises_is_counted_shown_and_the_engine_keeps_serving(console_env, monkeypatch):
    console = host().console

    def broken(*args, **kwargs) -> None:
        raise RuntimeError("a bug in what the console keeps of each step")

    with monkeypatch.context() as patch:  # the listener's in-memory part, after persisting (pages use it too)
        patch.setattr(console.history, "offer", broken)
        request_id = console.engine.submit(list(range(10, 60)), PARAMS)
        wait_idle()
    assert console.engine.get(request_id).status == "finished" and console.engine.failure is None
    failures = console.listener_errors
    assert failures >= 1
    flush_history()  # the history part of the listener ran before the broken part
    assert request_id in set(queries.recent_requests(host().db, console.run_id)["request_id"])
    at = open_page("overview")
    no_exceptions(at)
    assert f"{failures} engine-listener calls failed; see the server log." in errors(at)


def test_a_killed_writer_process_is_shown_on_every_page_and_history_goes_on(console_env):
    writer = host().writer
    first_pid = writer.pid
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: writer.stats().restarts == 1 and writer.stats().schema_ready, "the writer process to restart")
    console = host().console
    request_id = console.engine.submit(list(range(10, 60)), PARAMS)
    wait_idle()
    flush_history()
    assert writer.pid != first_pid
    assert request_id in set(queries.recent_requests(host().db, console.run_id)["request_id"])
    for name in PAGES:
        at = open_page(name)
        no_exceptions(at)
        assert "history writer process stopped unexpectedly and was restarted (1 time)" in warnings_and_errors(at), name
    metrics = {m.label: m.value for m in at.switch_page("../pages/overview.py").run().metric}
    assert metrics["Writer restarts"] == "1"


def test_a_full_history_disk_is_shown_on_every_page_and_the_engine_keeps_serving(
    console_env, small_disk: Path, monkeypatch
):
    url = f"sqlite:///{small_disk / 'history.sqlite'}"
    migrate.upgrade(url)
    fill_disk(small_disk, leave_bytes=64 * 1024)  # room to open the history, not to grow it
    monkeypatch.setenv("PREFIX_CONSOLE_DB_URL", url)
    console = host().console
    ids = [console.engine.submit([10 + i] + list(range(100, 147)), PARAMS) for i in range(20)]
    wait_idle()
    assert {console.engine.get(request_id).status for request_id in ids} == {"finished"}
    writer = host().writer
    wait_for(lambda: writer.stats().retrying and "full" in writer.stats().last_error, "the writer to hit the full disk")
    for name in PAGES:
        at = open_page(name)
        no_exceptions(at)
        assert "History database unavailable" in warnings_and_errors(at), name
        assert "database or disk is full" in warnings_and_errors(at), name
    assert console.engine.failure is None
    writer.close(timeout_s=1)  # it gives up its rows after a second instead of retrying for two minutes
    wait_for(lambda: writer.stats().queued == 0, "the writer to count what it gave up")
    stats = writer.stats()
    assert stats.dropped > 0 and stats.failed_batches >= 1


def test_after_a_reset_the_evictions_page_waits_for_the_writer_and_shows_the_rows(console_env):
    """Read-your-writes: no Refresh, no flush by the test; the page itself waits for the reset's rows."""
    console_env(num_blocks=16)
    engine = host().console.engine
    engine.submit(list(range(10, 58)), PARAMS)  # 3 full blocks stay cached
    wait_idle()
    at = open_page("settings")
    at.button(key="settings_reset").click().run()
    at.button(key="settings_reset_confirm").click().run()
    assert "Prefix cache reset: 3 blocks evicted; the cache is empty." in [s.value for s in at.success]
    at = at.switch_page("../pages/evictions.py").run()
    no_exceptions(at)
    assert "3 evictions" in [h.value for h in at.subheader]
    assert "has not stored" not in texts(at)


def test_a_page_that_waited_long_enough_says_what_is_missing_and_shows_it_once_stored(console_env, monkeypatch):
    """The writer stopped (SIGSTOP) right after a reset: the Evictions page waits HISTORY_WAIT_S, says which
    rows are missing and how far behind the writer is, and shows them once the writer runs again."""
    monkeypatch.setattr(ui, "HISTORY_WAIT_S", 1.0)
    console_env(num_blocks=16)
    engine = host().console.engine
    engine.submit(list(range(10, 58)), PARAMS)  # 3 full blocks stay cached
    wait_idle()
    flush_history()
    writer = host().writer
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        at = open_page("settings")
        at.button(key="settings_reset").click().run()
        at.button(key="settings_reset_confirm").click().run()
        at = at.switch_page("../pages/evictions.py").run()
        no_exceptions(at)
        assert "The history writer has not stored the reset's evictions yet" in warnings_and_errors(at)
        assert "0 evictions" in [h.value for h in at.subheader]  # what is stored so far
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    wait_for(lambda: writer.stats().lag_s == 0.0, "the writer to catch up")
    at.run()
    assert "3 evictions" in [h.value for h in at.subheader]
    assert "has not stored" not in warnings_and_errors(at)


def test_a_request_whose_logits_go_nan_is_recorded_failed_and_the_console_keeps_serving(console_env):
    """NaN injected through the weights: token 7's embedding row of the served model is set to NaN."""
    console = host().console
    with torch.no_grad():
        console.engine.loaded.model.get_input_embeddings().weight[7] = float("nan")
    bad = console.engine.submit([10, 11, 7, 12], PARAMS)
    good = console.engine.submit(list(range(10, 60)), PARAMS)
    wait_idle()
    assert console.engine.failure is None
    assert (console.engine.get(bad).status, console.engine.get(good).status) == ("failed", "finished")
    console.engine.check_invariants()
    assert console.engine.stats().used_blocks == 0
    flush_history()
    stored = queries.recent_requests(host().db, console.run_id).set_index("request_id")
    assert stored.loc[bad, "status"] == "failed"
    assert stored.loc[bad, "finish_reason"] == "non-finite logits (NaN or inf) at position 3"
    assert stored.loc[good, "status"] == "finished"


def test_a_restart_while_requests_run_ends_them_aborted_in_history_and_leaks_no_block(console_env):
    console_env(num_blocks=256)
    old = host().console
    retained = old.engine.submit(list(range(10, 60)), PARAMS, retain=True)
    wait_idle()
    running = [old.engine.submit([20 + i] + list(range(100, 130)), LONG) for i in range(3)]
    wait_for(lambda: all(old.engine.get(rid).output_token_ids for rid in running), "the requests to decode")
    at = open_page("settings")
    next(b for b in at.button if b.label == "Restart with these settings…").click().run()
    at.button(key="settings_restart_confirm").click().run()
    no_exceptions(at)
    assert host().console is not old

    ended = {rid: old.engine.get(rid) for rid in (retained, *running)}
    assert ended[retained].status == "released"
    for rid in running:
        assert (ended[rid].status, ended[rid].finish_reason) == ("aborted", RESTART_REASON)
        assert 0 < len(ended[rid].output_token_ids) < LONG.max_new_tokens
    old.engine.check_invariants()
    stats = old.engine.stats()
    assert (stats.used_blocks, stats.num_running, stats.num_waiting, stats.num_retained) == (0, 0, 0, 0)
    flush_history()
    stored = queries.recent_requests(host().db, old.run_id).set_index("request_id")
    for rid, view in ended.items():
        assert (stored.loc[rid, "status"], stored.loc[rid, "finish_reason"]) == (view.status, view.finish_reason)
        assert len(stored.loc[rid, "output_token_ids"]) == len(view.output_token_ids)
