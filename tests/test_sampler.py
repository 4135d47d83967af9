"""Sampler: greedy at temperature 0, seeded and nucleus-bounded otherwise."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import SamplingParams
from engine.runner.sampler import sample

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])


def test_temperature_zero_is_argmax():
    assert sample(LOGITS, [SamplingParams(), SamplingParams()], [None, None]) == [1, 0]


def test_seeded_generators_repeat_their_draws():
    params = [SamplingParams(temperature=1.0, seed=7)] * 2

    def draws(seed: int) -> list[list[int]]:
        generators = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)]
        return [sample(LOGITS, params, generators) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_p_keeps_only_the_nucleus():
    # softmax of row 0 at temperature 1: token 1 ~ 0.48, token 3 ~ 0.43; top_p 0.5 keeps both, never 0 or 2.
    params = [SamplingParams(temperature=1.0, top_p=0.5)]
    generator = torch.Generator().manual_seed(0)
    seen = {sample(LOGITS[:1], params, [generator])[0] for _ in range(200)}
    assert seen == {1, 3}


def test_tiny_top_p_is_greedy():
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 2
    assert sample(LOGITS, params, [torch.Generator(), torch.Generator()]) == [1, 0]


def test_row_count_mismatch_is_refused():
    with pytest.raises(ValueError):
        sample(LOGITS, [SamplingParams()], [None])
