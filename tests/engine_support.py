"""Helpers the engine tests share (fixtures live in tests/conftest.py)."""

from __future__ import annotations

import random

HYBRID_WINDOW = 8  # the window of the hybrid tiny-llama the sliding-window tests run ("hybrid:8")
RUNNER_BLOCK_SIZE = 4  # the model-runner tests' block size and pool
RUNNER_NUM_BLOCKS = 48


def tokens(n: int, seed: int) -> list[int]:
    """`n` token ids drawn from `seed`, clear of the tiny presets' special ids (0, 1, 2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]
