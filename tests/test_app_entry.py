"""The entry: lists every page with st.navigation and every page runs without an exception."""

from __future__ import annotations

from pathlib import Path

from tests.test_app_support import PAGES, ROOT, app, console_env, no_exceptions, open_page  # noqa: F401


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
            "Overview", "Submit & fork", "Blocks", "Prefix tree", "Replay", "Evictions", "Settings",
            "Fleet pods", "Fleet prefix tree", "Fleet evictions and lifetimes", "Route a prompt",
        }  # fmt: skip


def test_a_bad_environment_is_reported_not_raised(console_env, monkeypatch):
    monkeypatch.setenv("PREFIX_CONSOLE_NUM_BLOCKS", "many")
    at = app().run()
    assert [e.value for e in at.error] == ["The engine could not start: PREFIX_CONSOLE_NUM_BLOCKS must be an integer, got 'many'"]
