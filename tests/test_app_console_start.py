"""How the console starts: a notice before the heavy imports, passive OpenMP threads, a warm engine, and an
empty data-directory variable that falls back to ./data (issue 15)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from streamlit.testing.v1 import AppTest

from app.hosting import config_from_env
from engine.engine import Engine
from storage.db import default_db_url
from tests.test_app_support import ROOT, console_env, host  # noqa: F401


def show_notice() -> None:
    from app.loading import HOST_STARTED, loading_notice

    HOST_STARTED.clear()
    loading_notice()


def test_the_first_visit_says_the_model_is_loading_and_what_is_happening():
    """Regression: the first visit was an empty page for ~9 s (30 s while weights converted)."""
    at = AppTest.from_function(show_notice).run()
    notice = at.info[0].value
    assert notice.startswith("**Loading the model and starting the engine…**")
    assert all(step in notice for step in ("torch", "converted to safetensors", "KV block pool", "warm-up"))


def test_the_notice_comes_before_anything_loads_torch():
    entry = ast.parse((ROOT / "app" / "streamlit_app.py").read_text())
    order = [ast.unparse(node) for node in entry.body]
    passive = next(i for i, line in enumerate(order) if "set_openmp_defaults()" in line)
    notice = next(i for i, line in enumerate(order) if "loading_notice()" in line)
    hosting = next(i for i, line in enumerate(order) if line.startswith("from app.hosting import"))
    assert passive < notice < hosting
    probe = "import sys, app.loading; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_engine_is_warmed_up_before_it_starts_serving(console_env, monkeypatch):
    """The first request after a start paid a first forward's one-time costs; the host warms the engine
    up before its loop starts (timings live in benchmarks/first_request.py, not in tests)."""
    calls = []
    original = Engine.warm_up

    def recording(engine, *args, **kwargs):
        calls.append(engine._thread is None)  # not serving yet
        return original(engine, *args, **kwargs)

    monkeypatch.setattr(Engine, "warm_up", recording)
    engine = host().console.engine
    assert calls == [True]
    assert engine.stats().steps == 0 and engine.stats().used_blocks == 0  # and it changed no state


def test_an_empty_data_dir_variable_keeps_the_console_out_of_the_repository_root(tmp_path, monkeypatch):
    """Regression: PREFIX_CONSOLE_DATA_DIR="" wrote models/ and history.sqlite into the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFIX_CONSOLE_DB_URL", raising=False)
    config = config_from_env({"PREFIX_CONSOLE_DATA_DIR": ""})
    assert config.resolved_data_dir == tmp_path / "data"
    assert default_db_url(config.resolved_data_dir) == f"sqlite:///{tmp_path / 'data' / 'history.sqlite'}"
    assert os.listdir(tmp_path) == []
