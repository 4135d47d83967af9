"""Shared fixtures: seeded tiny models and the converted SmolLM2, all offline.

The SmolLM2 conversion (~15 s of GGUF dequantization) lands in $PREFIX_CONSOLE_TEST_DATA_DIR, by
default `data/test-cache` under the repository, so it happens once per machine, not once per run.

The history-store fixtures (databases, writers) live in tests/storage_support.py and the browser test's
server in tests/browser_support.py; both are registered here. The page tests import theirs from
tests/test_app_support.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

pytest_plugins = ["tests.storage_support", "tests.browser_support"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing reaches a hub

from engine.models import LoadedModel, ensure_smollm2_converted, load_model  # noqa: E402

TEST_DATA_DIR = Path(
    os.environ.get("PREFIX_CONSOLE_TEST_DATA_DIR", Path(__file__).resolve().parent.parent / "data" / "test-cache")
)


@pytest.fixture(scope="session")
def test_data_dir() -> Path:
    """Data dir shared by every test run on this machine (holds the converted SmolLM2)."""
    TEST_DATA_DIR.mkdir(parents=True, exist_ok=True)
    return TEST_DATA_DIR


@pytest.fixture(scope="session")
def smollm2_dir(test_data_dir: Path) -> Path:
    """The safetensors copy of SmolLM2-135M-Instruct, converted from the packaged GGUF on first use."""
    return ensure_smollm2_converted(test_data_dir)


@pytest.fixture
def make_model(test_data_dir: Path) -> Callable[..., LoadedModel]:
    """Factory for fresh fp32 CPU models (a runner takes over its model, so each caller gets its own).

    Call as `make_model("tiny-llama")` or `make_model("tiny-llama", attention_override="hybrid:5")`.
    """

    def make(name: str, *, attention_override: str | None = None, seed: int = 0) -> LoadedModel:
        return load_model(
            name,
            dtype="float32",
            device="cpu",
            data_dir=test_data_dir,
            seed=seed,
            attention_override=attention_override,
        )

    return make
