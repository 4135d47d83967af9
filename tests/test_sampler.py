"""Sampler: greedy at temperature 0, seeded and nucleus-bounded otherwise."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import SamplingParams
from engine.runner.sampler import sample, token_logprobs

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


def test_a_logit_bias_moves_the_greedy_choice_and_only_its_row():
    params = [SamplingParams(logit_bias=((2, 5.0),)), SamplingParams()]
    assert sample(LOGITS, params, [None, None]) == [2, 0]


def test_a_presence_penalty_counts_each_output_token_once():
    # Row 0: token 1 (3.0) leads token 3 (2.9); token 1 three times in the output, penalty 0.05 each time
    # would sink it as a frequency penalty (3.0 - 0.15 < 2.9), but once as a presence penalty it stays ahead.
    presence = [SamplingParams(presence_penalty=0.05)]
    frequency = [SamplingParams(frequency_penalty=0.05)]
    assert sample(LOGITS[:1], presence, [None], [[1, 1, 1]]) == [1]
    assert sample(LOGITS[:1], frequency, [None], [[1, 1, 1]]) == [3]
    assert sample(LOGITS[:1], frequency, [None], [[3, 0]]) == [1]  # tokens it does not hold are not penalized


def test_a_negative_penalty_favours_what_the_output_holds():
    assert sample(LOGITS[:1], [SamplingParams(presence_penalty=-0.5)], [None], [[3]]) == [3]


def test_penalties_need_the_output_tokens():
    with pytest.raises(ValueError):
        sample(LOGITS[:1], [SamplingParams(presence_penalty=1.0)], [None])


def test_a_banned_token_is_never_drawn():
    params = [SamplingParams(temperature=1.0, logit_bias=((1, -100.0),))]
    generator = torch.Generator().manual_seed(0)
    assert 1 not in {sample(LOGITS[:1], params, [generator], [[]])[0] for _ in range(200)}


def test_logprobs_are_of_the_raw_logits_with_the_top_tokens_most_likely_first():
    raw = torch.log_softmax(LOGITS, dim=-1)
    first, second = token_logprobs(LOGITS, [2, 0], [2, 0])
    assert first.logprob == pytest.approx(float(raw[0, 2]))
    assert [token for token, _ in first.top] == [1, 3]
    assert first.top[0][1] == pytest.approx(float(raw[0, 1]))
    assert second == (pytest.approx(float(raw[1, 0])), ())


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": float("nan")},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((1, 1.0), (1, 2.0))},
        {"logit_bias": tuple((i, 1.0) for i in range(301))},
        {"logprobs": 21},
        {"logprobs": -1},
    ],
)
def test_sampling_params_out_of_bounds_are_refused(fields):
    with pytest.raises(ValueError):
        SamplingParams(**fields)
