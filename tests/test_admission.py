"""The admission step names the field and the bound of every refusal, and admits what fits."""

from __future__ import annotations

import pytest

from engine.core.admission import (
    MAX_CHOICES,
    MAX_NEW_TOKENS,
    MAX_STOP_SEQUENCES,
    AdmissionError,
    ModelLimits,
    RequestInput,
    admit,
    never_fits,
    room_for_output,
)
from engine.core.request import SamplingParams

LIMITS = ModelLimits(vocab_size=100, max_model_len=64)
SAMPLING = SamplingParams(max_new_tokens=8)


@pytest.mark.parametrize(
    ("given", "field", "bound"),
    [
        (RequestInput([], SAMPLING), "prompt", "a non-empty list of token ids"),
        (RequestInput([5, 100], SAMPLING), "prompt", "token ids in the vocabulary [0, 100)"),
        (RequestInput([5] * 57, SAMPLING), "prompt", "at most 56 tokens long"),
        (RequestInput([5], SAMPLING, salt="s" * 257), "salt", "None or a string of at most 256 characters"),
        (RequestInput([5], SAMPLING, stop=["x"] * 5), "stop", f"at most {MAX_STOP_SEQUENCES} stop sequences"),
        (RequestInput([5], SAMPLING, num_choices=MAX_CHOICES + 1), "num_choices", f"an integer in [1, {MAX_CHOICES}]"),
        (RequestInput([5], SamplingParams(logit_bias=((100, 1.0),))), "logit_bias", "keyed by token ids in the vocabulary"),
    ],
)
def test_each_refusal_names_its_field_and_its_bound(given, field, bound):
    with pytest.raises(AdmissionError) as refused:
        admit(given, LIMITS)
    assert refused.value.field == field and refused.value.bound.startswith(bound)
    assert str(refused.value) == refused.value.describe(field) and refused.value.describe("n").startswith("n must be")


def test_sampling_out_of_its_bounds_is_refused_when_built():
    with pytest.raises(AdmissionError) as refused:
        SamplingParams(max_new_tokens=MAX_NEW_TOKENS + 1)
    assert (refused.value.field, refused.value.bound) == ("max_new_tokens", f"an integer in [1, {MAX_NEW_TOKENS}]")


def test_a_context_that_fits_is_admitted_behind_its_prefix():
    assert admit(RequestInput([7, 8], SAMPLING), LIMITS, prefix=[1, 2, 3], what="fork suffix") == [1, 2, 3, 7, 8]
    assert admit(RequestInput((5,) * 56, SAMPLING), LIMITS) == [5] * 56


def test_room_for_output_is_what_the_length_check_allows():
    assert room_for_output(60, LIMITS) == 4 and room_for_output(64, LIMITS) == 1
    admit(RequestInput([5] * 60, SamplingParams(max_new_tokens=room_for_output(60, LIMITS))), LIMITS)


def test_a_request_larger_than_the_whole_pool_never_fits():
    assert never_fits(30, 2, block_size=4, num_blocks=8) is None
    assert never_fits(31, 2, block_size=4, num_blocks=8) == "needs 9 blocks for its context and new tokens; the whole pool has 8"
