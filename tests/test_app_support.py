"""Fixtures and helpers shared by the AppTest page tests (this module holds no tests itself).

Every test gets its own engine and SQLite history: the environment points the console at the tiny-chat
model (random weights, SmolLM2's tokenizer and chat template) and a temporary database, and the
process-wide `st.cache_resource` is cleared before and after, which shuts the engine and writer down.
The tokenizer cache is shared between tests (and runs) under data/test-cache
($PREFIX_CONSOLE_TEST_DATA_DIR), like the engine tests' conftest.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from app.hosting import ConsoleHost, get_host

ROOT = Path(__file__).resolve().parent.parent
ENTRY = str(ROOT / "app" / "streamlit_app.py")
TEST_DATA_DIR = Path(os.environ.get("PREFIX_CONSOLE_TEST_DATA_DIR", ROOT / "data" / "test-cache"))  # as tests/conftest.py
PAGES = (
    "overview", "submit", "blocks", "prefix_tree", "replay", "evictions", "why", "settings", "capacity_planner",
    "fleet_pods", "fleet_tree", "fleet_evictions", "fleet_route",
)  # fmt: skip
TIMEOUT_S = 60


@pytest.fixture
def console_env(tmp_path, monkeypatch) -> Iterator[Callable[..., None]]:
    """Point the console at tiny-chat and a fresh database; call it to override pool settings."""

    def configure(
        num_blocks: int = 64, block_size: int = 16, model: str = "tiny-chat", attention: str | None = None
    ) -> None:
        monkeypatch.setenv("PREFIX_CONSOLE_MODEL", model)
        monkeypatch.setenv("PREFIX_CONSOLE_NUM_BLOCKS", str(num_blocks))
        monkeypatch.setenv("PREFIX_CONSOLE_BLOCK_SIZE", str(block_size))
        monkeypatch.setenv("PREFIX_CONSOLE_DEVICE", "cpu")
        monkeypatch.setenv("PREFIX_CONSOLE_DB_URL", f"sqlite:///{tmp_path / 'history.sqlite'}")
        monkeypatch.setenv("PREFIX_CONSOLE_DATA_DIR", str(TEST_DATA_DIR))
        opt_in = ("PREFIX_CONSOLE_FLEET_PODS", "PREFIX_CONSOLE_KV_EVENTS_ENDPOINT", "PREFIX_CONSOLE_METRICS_PORT",
                  "PREFIX_CONSOLE_ENGINE")  # fmt: skip
        for name in opt_in:
            monkeypatch.delenv(name, raising=False)  # the fleet, the feeds and the API are opt-in
        if attention is None:
            monkeypatch.delenv("PREFIX_CONSOLE_ATTENTION", raising=False)
        else:
            monkeypatch.setenv("PREFIX_CONSOLE_ATTENTION", attention)
        st.cache_resource.clear()

    configure()
    yield configure
    st.cache_resource.clear()  # on_release: stop the engine thread, close the writer


@pytest.fixture
def streamlit_logs() -> Iterator[list[logging.LogRecord]]:
    """Every record Streamlit's own loggers emit during the test, INFO and up.

    Streamlit's loggers do not propagate (caplog never sees them), so a recording handler is put on each
    one: deprecation warnings (`use_container_width`) and the dataframe fallback ("Serialization of
    dataframe to Arrow table was unsuccessful", logged at INFO) land here.
    """
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    names = [name for name in logging.root.manager.loggerDict if name.split(".")[0] == "streamlit"]
    loggers = [logging.getLogger(name) for name in {*names, "streamlit.deprecation_util", "streamlit.dataframe_util"}]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield records
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


def host() -> ConsoleHost:
    """The host the app under test uses (the same process-wide cached resource)."""
    return get_host()


def app() -> AppTest:
    return AppTest.from_file(ENTRY, default_timeout=TIMEOUT_S)


def open_page(name: str, at: AppTest | None = None) -> AppTest:
    """Run the entry, then switch to `pages/<name>.py` and run it."""
    at = at or app().run()
    return at.switch_page(f"../pages/{name}.py").run()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def wait_idle() -> None:
    engine = host().console.engine
    wait_for(lambda: not engine.has_work(), "the engine to go idle")


def flush_history() -> None:
    assert host().writer.flush(timeout_s=TIMEOUT_S), "the history writer did not flush"


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def no_exceptions(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def button(at: AppTest, key: str):
    return at.button(key=key)


def texts(at: AppTest) -> str:
    """Every markdown, caption, success, info and warning text on the page, joined."""
    parts = []
    for kind in ("markdown", "caption", "success", "info", "warning", "error", "code", "text"):
        parts += [str(e.value) for e in getattr(at, kind)]
    return "\n".join(parts)
