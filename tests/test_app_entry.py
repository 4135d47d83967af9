"""The entry: lists every page with st.navigation and every page runs without an exception."""

from __future__ import annotations

from pathlib import Path

from engine.core.request import SamplingParams
from tests.test_app_support import (  # noqa: F401  (console_env and streamlit_logs are fixtures)
    PAGES,
    ROOT,
    app,
    console_env,
    host,
    no_exceptions,
    open_page,
    streamlit_logs,
    wait_idle,
)


def test_entry_lists_all_pages(console_env):
    at = app().run()
    no_exceptions(at)
    registered = {Path(str(info["script_path"])).resolve() for info in at._registered_pages.values()}
    assert registered == {ROOT / "pages" / f"{name}.py" for name in PAGES}
    assert [m.label for m in at.metric][:1] == ["KV usage"]  # the default page is the Overview


def test_every_page_runs(console_env):
    at = app().run()
    for name in PAGES:
        at = open_page(name, at)
        no_exceptions(at)
        assert not at.error, (name, [e.value for e in at.error])
        assert at.title[0].value in {
            "Overview", "Submit & fork", "Blocks", "Prefix tree", "Replay", "Evictions", "Why did it miss?", "Settings",
            "Capacity planner",
            "Fleet pods", "Fleet prefix tree", "Fleet evictions and lifetimes", "Route a prompt",
        }  # fmt: skip


def test_a_bad_environment_is_reported_not_raised(console_env, monkeypatch):
    monkeypatch.setenv("PREFIX_CONSOLE_NUM_BLOCKS", "many")
    at = app().run()
    assert [e.value for e in at.error] == ["The engine could not start: PREFIX_CONSOLE_NUM_BLOCKS must be an integer, got 'many'"]


def test_every_page_of_a_hybrid_model_with_forks_and_replays_logs_nothing(console_env, streamlit_logs):
    """Regression (issue 15): the console's log carried `use_container_width` deprecation warnings and
    pyarrow conversion errors (the hybrid model's per-group table mixed ints and strings in `window`)."""
    console_env(block_size=4, attention="hybrid:8")
    engine = host().console.engine
    prefix = list(range(100, 140))
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    parent = engine.submit(prefix, params, request_id="doc", retain=True)
    wait_idle()
    engine.fork_many(parent, [[5], [6]], params, retain=True)
    engine.submit(prefix[:36] + [7, 8, 9], params, request_id="reader")  # an exact replay
    wait_idle()
    engine.release(parent)
    at = app().run()
    for name in PAGES:
        at = open_page(name, at)
        no_exceptions(at)
    # The test's own host() calls run outside a script: Streamlit notes "bare mode" for those, not the app.
    logged = [(r.name, r.getMessage()) for r in streamlit_logs if "bare mode" not in r.getMessage()]
    assert logged == []
