"""Support for tests/test_cascade_attention.py: random fork scenarios and the runners they run on.

A scenario is families of a parent context and forks sharing 0 to all of its full blocks, each fork with
its own cached tokens, then one step mixing decodes and prefill chunks of every sequence.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import strategies as st

from engine.runner.attention_plan import ALWAYS_CASCADE, NO_CASCADE
from engine.core.config import EngineConfig
from engine.runner.model_runner import GroupSlots, ModelRunner, SeqChunk
from engine.runner.model_loading import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 128
SCENARIO_MODELS = [("tiny-llama", None), ("tiny-llama", "hybrid:5"), ("tiny-mistral", None)]


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


@st.composite
def scenarios(draw):
    """Families (a parent context and forks sharing 0..all of its full blocks), then one mixed step.

    Blocks come from a fresh pool (consecutive ids: reads become views) or a shuffled one (gathers)."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    free = list(range(NUM_BLOCKS))[::-1]  # popped from the end: consecutive blocks, as a fresh pool hands out
    if draw(st.booleans()):
        rng.shuffle(free)
    families = []
    for _ in range(draw(st.integers(1, 3))):
        parent_len = draw(st.integers(1, 20))
        parent = {"context": tokens(parent_len, rng), "table": [free.pop() for _ in range(-(-parent_len // BLOCK_SIZE))]}
        forks = []
        for _ in range(draw(st.integers(1, 4))):
            depth = draw(st.integers(0, parent_len // BLOCK_SIZE))
            own_len = draw(st.integers(0, 9))
            context = parent["context"][: depth * BLOCK_SIZE] + tokens(own_len, rng)
            if not context:
                context = tokens(1, rng)
            forks.append({"depth": depth, "context": context, "table": parent["table"][:depth]})
        families.append((parent, forks))
    sequences = []
    for parent, forks in families:
        for seq in [parent, *forks]:
            new = draw(st.sampled_from([1, 1, 1, 2, 5]))
            seq["new"] = tokens(new, rng)
            total = len(seq["context"]) + new
            while len(seq["table"]) * BLOCK_SIZE < total:
                seq["table"].append(free.pop())
            sequences.append(seq)
    return families, sequences, draw(st.integers(0, 2))


def run_scenario(runner: ModelRunner, families, sequences, sliding_offset: int) -> torch.Tensor:
    """Prefill parents, then forks' own tokens, then one step of every sequence's new tokens."""

    def chunk(token_ids, start, table, final):
        groups = []
        for spec in runner.groups:
            first = 0
            if spec.window is not None and final:  # a sliding table may start at the window, as the engine's do
                first = min(sliding_offset, max(0, start - spec.window + 1) // BLOCK_SIZE)
            groups.append(GroupSlots(table[first:], first, start))
        return SeqChunk(token_ids, start, tuple(groups))

    runner.execute([chunk(parent["context"], 0, parent["table"], False) for parent, _ in families])
    owned = [
        chunk(fork["context"][fork["depth"] * BLOCK_SIZE :], fork["depth"] * BLOCK_SIZE, fork["table"], False)
        for _, forks in families
        for fork in forks
        if len(fork["context"]) > fork["depth"] * BLOCK_SIZE
    ]
    if owned:
        runner.execute(owned)
    return runner.execute([chunk(seq["new"], len(seq["context"]), seq["table"], True) for seq in sequences])


@pytest.fixture(scope="module")
def runners(test_data_dir):
    """(plain, cascade, reference) per model, on the same seeded weights; each example rewrites what it reads.
    The plain runner also runs its decodes as a padded, masked batch; the cascade one reads them in place."""

    def load(name, override):
        return load_model(EngineConfig(model=name, device="cpu", data_dir=test_data_dir, attention_override=override))

    built = {}
    for name, override in SCENARIO_MODELS:
        plain = ModelRunner(load(name, override), NUM_BLOCKS, BLOCK_SIZE, cascade=NO_CASCADE)
        plain.kernels = dataclasses.replace(plain.kernels, decodes=None)
        cascade = ModelRunner(load(name, override), NUM_BLOCKS, BLOCK_SIZE, cascade=ALWAYS_CASCADE)
        if cascade.kernels.decodes is None:
            raise RuntimeError(f"the paged decode kernel is not in use: {cascade.kernels.notes}")
        built[name, override] = (plain, cascade, load(name, override))
    return built
