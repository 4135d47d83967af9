"""Helpers for the own-workload tests: a namespace, token prompts with shared prefixes and tenants, and
the run-trace file that submits them (this module holds no tests)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from engine.core.namespace import CacheNamespace

NAMESPACE = CacheNamespace("tiny-llama", "rev-1", "float32", 4, ("full",))
STEMS = [list(range(10, 22)), list(range(10, 18)) + [90, 91, 92, 93], list(range(40, 48))]  # 3, 3 and 2 blocks


def token_prompts(count: int = 40, seed: int = 0) -> list[tuple[list[int], str | None]]:
    """(tokens, salt) per request: a stem (two stems share their first two blocks) and 0-3 more whole
    blocks, a tenant salt for some; whole blocks only (see tests/test_analysis_pool.py)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        stem = rng.choice(STEMS)
        tail = [rng.randrange(100, 104) for _ in range(4 * rng.randrange(0, 4))]
        prompts.append((stem + tail, rng.choice([None, None, "tenant-a"])))
    return prompts


def write_run_trace(tmp_path: Path, prompts: list[tuple[list[int], str | None]], name: str = "workload.jsonl") -> Path:
    """A run-trace file submitting `prompts` in order (then one `run`)."""
    lines = [
        {"op": "submit", "id": f"r{i}", "tokens": tokens, "max_new_tokens": 2, **({"salt": salt} if salt else {})}
        for i, (tokens, salt) in enumerate(prompts)
    ]
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(line) for line in lines + [{"op": "run"}]) + "\n")
    return path
