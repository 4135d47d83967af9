"""The tiled attention kernel (engine/runner/csrc/tiled_attention.cpp) against MATH, and its refusals.
`make install` builds it; a CPU runner must use it for its unmasked calls."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runner.attention_kernels import Kernel, attend, choose_kernels
from tests.engine_support import kernel_ops


def as_runner_passes(values: torch.Tensor) -> torch.Tensor:
    """[B, L, heads, d] rows of heads, seen as [B, heads, L, d] (a transposed view, as the runner passes it)."""
    return values.transpose(1, 2)


# float32: summation order only; bf16: the output's rounding, and (on bf16 dot products) the weights'
OUT_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@st.composite
def calls(draw):
    """Causal own-token calls and unmasked calls of any query count over any key count, key counts that
    end anywhere in a key block, few queries over many keys (the keys split across threads), grouped heads."""
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([16, 32, 48, 64, 128]))
    batch = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    keys = draw(st.integers(1, 300)) if causal else draw(st.integers(1, 1100))
    queries = keys if causal else draw(st.integers(1, 40))
    return batch, kv_heads * group, kv_heads, queries, keys, head_dim, causal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=40, deadline=None)
@given(call=calls(), seed=st.integers(0, 2**16))
def test_tiled_attention_matches_math(dtype, call, seed):
    batch, heads, kv_heads, queries, keys, head_dim, causal = call
    generator = torch.Generator().manual_seed(seed)
    q = as_runner_passes(torch.randn(batch, queries, heads, head_dim, generator=generator).to(dtype))
    k, v = (as_runner_passes(torch.randn(batch, keys, kv_heads, head_dim, generator=generator).to(dtype)) for _ in range(2))
    out, lse = kernel_ops().tiled_attention(q, k, v, causal, head_dim**-0.5)
    want_out, want_lse = attend(q, k, v, scale=head_dim**-0.5, causal=causal, kernel=Kernel.MATH)
    assert out.shape == q.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert (out.float() - want_out.float()).abs().max().item() < OUT_TOLERANCE[dtype]
    assert (lse - want_lse).abs().max().item() < 2e-5 * max(1.0, want_lse.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [1, 8, 24, 2048])
def test_many_or_few_queries_over_a_long_shared_prefix_match_math(queries, dtype):
    """Decodes over a 1,024-token prefix (too few tiles for the threads, so the keys are split into
    ranges) and the 64-request prefill's 2,048 rows over it."""
    generator = torch.Generator().manual_seed(queries)
    q = as_runner_passes(torch.randn(1, queries, 9, 64, generator=generator).to(dtype))
    k, v = (as_runner_passes(torch.randn(1, 1024, 3, 64, generator=generator).to(dtype)) for _ in range(2))
    out, lse = kernel_ops().tiled_attention(q, k, v, False, 0.125)
    want_out, want_lse = attend(q, k, v, scale=0.125, kernel=Kernel.MATH)
    assert (out.float() - want_out.float()).abs().max().item() < OUT_TOLERANCE[dtype]
    assert (lse - want_lse).abs().max().item() < 2e-5 * max(1.0, want_lse.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_causal_call_matches_math_at_every_row(dtype):
    """1,056 own tokens (17 key blocks, a partial last one), SmolLM2's heads: the cold prefill's call."""
    generator = torch.Generator().manual_seed(5)
    q = as_runner_passes(torch.randn(1, 1056, 9, 64, generator=generator).to(dtype))
    k, v = (as_runner_passes(torch.randn(1, 1056, 3, 64, generator=generator).to(dtype)) for _ in range(2))
    out, lse = kernel_ops().tiled_attention(q, k, v, True, 0.125)
    want_out, want_lse = attend(q, k, v, scale=0.125, causal=True, kernel=Kernel.MATH)
    assert (out.float() - want_out.float()).abs().max().item() < OUT_TOLERANCE[dtype]
    assert (lse - want_lse).abs().max().item() < 2e-5 * max(1.0, want_lse.abs().max().item())


@pytest.mark.parametrize("rise", [0.05, 1.0, 7.5, 30.0])
@pytest.mark.parametrize("queries", [1, 40])
def test_scores_that_climb_block_after_block_match_a_float64_reference(rise, queries):
    """Each row's scores rise by about `rise` a key block (64 keys). A row's softmax shift moves only when a
    score passes it by more than 8: below that its weights grow up to e^8; above, it moves every block,
    and the last scores (~330) are past exp's float32 range unless shifted. One query: keys split into
    ranges. Scores that large round in float32 wherever they are computed: the kernel must come as close
    to a float64 reference as torch's float32 flash kernel does (within 4x its error)."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(1, queries, 3, 64, generator=generator)
    q[..., 0] = 8.0  # times the scale 0.125: key component 0 adds to the score as it is
    k, v = (torch.randn(1, 700, 1, 64, generator=generator) for _ in range(2))
    k[..., 0] = rise * (torch.arange(700) // 64).view(1, 700, 1)
    q, k, v = (as_runner_passes(tensor) for tensor in (q, k, v))
    out, lse = kernel_ops().tiled_attention(q, k, v, False, 0.125)
    scores = 0.125 * q.double() @ k.double().transpose(-1, -2)  # [1, 3, queries, 700]: the one KV head's keys
    exact_out, exact_lse = torch.softmax(scores, dim=-1) @ v.double(), torch.logsumexp(scores, dim=-1)
    flash_out, flash_lse = attend(q, k, v, scale=0.125, kernel=Kernel.CPU_FLASH)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (out - exact_out).abs().max() <= 4 * (flash_out - exact_out).abs().max() + 1e-7
    assert (lse - exact_lse).abs().max() <= 4 * (flash_lse - exact_lse).abs().max() + 1e-7


@pytest.mark.parametrize("keys", [70, 1024])  # one pass; key ranges merged by their log-sum-exps
def test_a_nan_in_one_element_reaches_no_other_element(keys):
    q = as_runner_passes(torch.randn(2, 5, 4, 16))
    k, v = (as_runner_passes(torch.randn(2, keys, 2, 16)) for _ in range(2))
    k[0, 0, 3, 0] = float("nan")
    out, lse = kernel_ops().tiled_attention(q, k, v, False, 0.25)
    want_out, want_lse = attend(q[1:], k[1:], v[1:], scale=0.25, kernel=Kernel.MATH)
    assert (out[1:] - want_out).abs().max().item() < 2e-5 and (lse[1:] - want_lse).abs().max().item() < 2e-5
    assert torch.isnan(out[0]).any()


@pytest.mark.parametrize(
    ("shapes", "causal", "message"),
    [
        (((1, 4, 5, 24), (1, 2, 5, 24)), False, "multiple of 16"),
        (((1, 4, 5, 16), (1, 2, 7, 16)), True, "as many queries as keys"),
        (((1, 5, 5, 16), (1, 2, 5, 16)), False, "multiple of KV heads"),
        (((1, 4, 3, 16), (1, 2, 0, 16)), False, "at least one key"),
    ],
)
def test_bad_calls_are_refused(shapes, causal, message):
    q_shape, kv_shape = shapes
    with pytest.raises(RuntimeError, match=message):
        kernel_ops().tiled_attention(torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape), causal, 0.25)


def test_a_bias_is_refused_by_the_python_entry():
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="no bias"):
        attend(q, k, k, scale=0.25, bias=torch.zeros(1, 1, 3, 3), kernel=Kernel.CPU_TILED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_runner_uses_it_for_unmasked_calls(dtype):
    choice = choose_kernels(torch.device("cpu"), dtype, 9, 3, 64)
    assert (choice.unmasked, choice.masked, choice.notes) == (Kernel.CPU_TILED, Kernel.CPU_FLASH, ())


def test_a_head_size_it_refuses_falls_back_to_the_flash_kernel_with_a_note():
    choice = choose_kernels(torch.device("cpu"), torch.float32, 4, 2, 24)
    assert choice.unmasked is Kernel.CPU_FLASH
    assert any("tiled_attention (float32) unavailable" in note and "multiple of 16" in note for note in choice.notes)
