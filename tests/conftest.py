"""Shared fixtures: seeded tiny models and the converted SmolLM2, all offline.

The SmolLM2 conversion (~15 s of GGUF dequantization) lands in $PREFIX_CONSOLE_TEST_DATA_DIR, by
default `data/test-cache` under the repository, so it happens once per machine, not once per run.
Reference models (loaded once per session) are never handed to a runner, so tests can share them.

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
# Their asserts are checks too: rewritten like a test module's, they still run under `python -O`.
pytest.register_assert_rewrite("tests.engine_reference")

from engine.native_guard import refuse_stale_modules  # noqa: E402

# Refuse to run against a compiled block pool older than its source (build_native.py): Python would import
# the compiled module, and the tests would pass or fail on code that is no longer there. Importing
# engine.core below refuses too; saying it here keeps the refusal first whatever this file imports.
refuse_stale_modules()

from engine.core.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.runner.model_loading import LoadedModel, ensure_smollm2_converted, load_model  # noqa: E402
from tests.engine_reference import LogitSpy  # noqa: E402
from tests.engine_support import HYBRID_WINDOW, RUNNER_BLOCK_SIZE, RUNNER_NUM_BLOCKS  # noqa: E402


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


def load_cpu_model(name: str, data_dir: Path, *, attention_override: str | None = None, seed: int = 0) -> LoadedModel:
    """A fresh fp32 CPU copy of a preset (the way tests load models)."""
    config = EngineConfig(model=name, device="cpu", data_dir=data_dir, seed=seed, attention_override=attention_override)
    return load_model(config)


@pytest.fixture
def make_model(test_data_dir: Path) -> Callable[..., LoadedModel]:
    """Factory for fresh fp32 CPU models (a runner takes over its model, so each caller gets its own).

    Call as `make_model("tiny-llama")` or `make_model("tiny-llama", attention_override="hybrid:5")`.
    """

    def make(name: str, *, attention_override: str | None = None, seed: int = 0) -> LoadedModel:
        return load_cpu_model(name, test_data_dir, attention_override=attention_override, seed=seed)

    return make


# ---------------------------------------------------------------------------------------------- references
@pytest.fixture(scope="session")
def tiny_llama_reference(test_data_dir: Path) -> LoadedModel:
    """tiny-llama as transformers runs it: the reference of the engine tests."""
    return load_cpu_model("tiny-llama", test_data_dir)


@pytest.fixture(scope="session")
def hybrid_reference(test_data_dir: Path) -> LoadedModel:
    """tiny-llama with even layers sliding (window HYBRID_WINDOW): transformers' Ministral on its weights."""
    return load_cpu_model("tiny-llama", test_data_dir, attention_override=f"hybrid:{HYBRID_WINDOW}")


@pytest.fixture(scope="session")
def mistral_reference(test_data_dir: Path) -> LoadedModel:
    """tiny-mistral (every layer sliding) as transformers runs it."""
    return load_cpu_model("tiny-mistral", test_data_dir)


@pytest.fixture(scope="module")
def smollm2_pair(test_data_dir: Path) -> tuple[Engine, LogitSpy, LoadedModel]:
    """An engine on the real SmolLM2 weights, its logit spy, and a reference copy of the model."""
    reference = load_cpu_model("smollm2", test_data_dir)
    engine = Engine(EngineConfig(model="smollm2", device="cpu", block_size=16, num_blocks=128, data_dir=test_data_dir))
    return engine, LogitSpy(engine), reference


@pytest.fixture
def runner_pair(make_model) -> Callable[..., tuple[ModelRunner, LoadedModel]]:
    """Factory of (runner, reference) on the same seeded weights: `runner_pair("tiny-llama", "hybrid:5")`."""

    def make(name: str, attention_override: str | None = None) -> tuple[ModelRunner, LoadedModel]:
        loaded = make_model(name, attention_override=attention_override)
        runner = ModelRunner(loaded, RUNNER_NUM_BLOCKS, RUNNER_BLOCK_SIZE)
        return runner, make_model(name, attention_override=attention_override)

    return make
