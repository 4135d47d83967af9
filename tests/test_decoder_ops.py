"""A decoder layer's fused CPU steps (engine/runner/csrc/decoder_ops.cpp, `LayerSteps` with every op fused)
against the torch ops they replace (engine/runner/layer_steps.py): identical, except the RMSNorm's, which sums its mean in another order (a last-bit
difference of its float32 scale factor, which in bf16 flips a rounding now and then); in-place updates land
where the torch ops' results would."""

from __future__ import annotations

import pytest
import torch

from engine.runner import layer_steps as torch_steps
from engine.runner.decoder_forward import layer_steps
from engine.runner.kernel_probes import ProbeCase
from engine.runner.layer_steps import FUSED_STEPS, LayerSteps

HIDDEN, INTERMEDIATE, HEAD_DIM, HEADS = 96, 160, 16, 6


@pytest.fixture(scope="module")
def fused() -> LayerSteps:
    steps = layer_steps(torch.device("cpu"), ProbeCase(torch.float32, HEADS, 2, HEAD_DIM))
    assert steps.fused == FUSED_STEPS, f"not every step is fused (make install builds the library): {steps.name}"
    return steps


def same(got: torch.Tensor, want: torch.Tensor, last_bit: bool = False) -> None:
    """Identical, or (last_bit) within a rounding or two of the dtype: a last-bit change of the row's float32
    scale factor, carried through the two roundings after it (in bf16 it flips a rounding now and then)."""
    if last_bit:
        epsilon = torch.finfo(got.dtype).eps  # 2**-23 in float32, 2**-7 in bf16
        torch.testing.assert_close(got, want, rtol=4 * epsilon, atol=0)
    else:
        assert torch.equal(got, want)


def inputs(rows: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    return rand(rows, HIDDEN, scale=3.0), rand(rows, HIDDEN), rand(HIDDEN).abs() + 0.5, rand(rows, 2 * INTERMEDIATE, scale=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_norms_and_the_activation_equal_the_torch_ops(fused, dtype, rows):
    hidden, delta, weight, gate_up = inputs(rows, dtype, rows)
    same(fused.norm(hidden, weight, 1e-5), torch_steps.rms_norm(hidden, weight, 1e-5), last_bit=True)
    want_hidden, want_normed = torch_steps.add_rms_norm(hidden, delta, weight, 1e-5)
    in_place = hidden.clone()
    got_hidden, got_normed = fused.add_norm(in_place, delta, weight, 1e-5)
    assert got_hidden is in_place  # the sum is written into hidden
    same(got_hidden, want_hidden)
    same(got_normed, want_normed, last_bit=True)
    same(fused.silu_and_mul([gate_up]), torch_steps.silu_and_mul(*gate_up.chunk(2, dim=-1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_embedding_rotates_a_view_of_the_fused_output_in_place(fused, dtype):
    rows = 7
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows, (HEADS + 2) * HEAD_DIM, generator=generator).to(dtype)  # q|k then v, as the linear gives them
    angles = torch.rand(rows, HEAD_DIM // 2, generator=generator) * 6
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    qk = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    values_before = qkv[:, HEADS * HEAD_DIM :].clone()
    want = torch_steps.rope(qk, cos, sin)
    got = fused.rope(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    same(got, want)
    assert torch.equal(qkv[:, HEADS * HEAD_DIM :], values_before)  # the values beside it untouched


def test_bad_shapes_are_refused(fused):
    hidden, delta, weight, gate_up = inputs(4, torch.float32, 0)
    with pytest.raises(RuntimeError, match="weight must be"):
        fused.norm(hidden, weight[:-1], 1e-5)
    with pytest.raises(RuntimeError, match="delta must be like hidden"):
        fused.add_norm(hidden, delta[:, :-1], weight, 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        fused.norm(hidden, weight.double(), 1e-5)
    with pytest.raises(RuntimeError, match="2I"):
        fused.silu_and_mul([gate_up[:, :-1]])
