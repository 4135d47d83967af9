"""Engine configuration: where data lives."""

from __future__ import annotations

from engine.core.config import DATA_DIR_ENV, default_data_dir


def test_an_empty_data_dir_variable_falls_back_to_data(monkeypatch, tmp_path):
    """Regression: PREFIX_CONSOLE_DATA_DIR="" resolved to the working directory itself (the repository
    root under `make run`), so weights and the history landed beside the code."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, "")
    assert default_data_dir() == (tmp_path / "data").resolve()
    monkeypatch.delenv(DATA_DIR_ENV)
    assert default_data_dir() == (tmp_path / "data").resolve()
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "elsewhere"))
    assert default_data_dir() == (tmp_path / "elsewhere").resolve()
