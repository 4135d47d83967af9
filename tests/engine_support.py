"""Helpers the engine tests share (fixtures live in tests/conftest.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.runner.native_kernels import load_ops

HYBRID_WINDOW = 8  # the window of the hybrid tiny-llama the sliding-window tests run ("hybrid:8")
RUNNER_BLOCK_SIZE = 4  # the model-runner tests' block size and pool
RUNNER_NUM_BLOCKS = 48


def tokens(n: int, seed: int) -> list[int]:
    """`n` token ids drawn from `seed`, clear of the tiny presets' special ids (0, 1, 2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def kernel_ops() -> Any:
    """`torch.ops.prefix_console` with the engine's kernel library loaded; fails the test where the library
    is not usable (`make install` builds it)."""
    ops, why_not = load_ops()
    if ops is None:
        pytest.fail(f"the kernel library is not usable: {why_not}")
    return ops
