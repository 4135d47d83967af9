"""The panel linear kernel (engine/runner/csrc/panel_linear.cpp) and the packed linears that choose it
(engine/runner/packed_linear.py): results within the float32 error bound of an in-order sum, a row's
result independent of the rows beside it, the choice by row count, and refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from engine.runner.packed_linear import (
    PANEL_ROWS, PANEL_WIDTH, WIDENED_BF16_ROWS, onednn_has_bf16_matmul, pack_weight, packed_linear, packs_linears,
    panel_rows,
)
from tests.engine_support import kernel_ops

FLOAT32_EPS = 2.0**-24  # unit roundoff


def panels_of(weight: torch.Tensor) -> torch.Tensor:
    return kernel_ops().pack_panels(weight)


def within_bound(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """|got - exact| within the bound of a float32 sum over k in order (K u sum |x w|, plus the bias add),
    plus one rounding to got's dtype."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    magnitude = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    bound = (x.shape[1] + 1) * FLOAT32_EPS * magnitude + 1e-30
    if got.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8 + magnitude * 2.0**-16
    excess = (got.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the error bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.integers(1, 200),
    panels=st.integers(1, 6),
    with_bias=st.booleans(),
    row_gap=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_panel_linear_is_within_the_error_bound_of_an_in_order_sum(dtype, rows, in_features, panels, with_bias, row_gap, seed):
    """Any row count (micro tiles of every height), any K, rows with a gap between them (a strided view)."""
    generator = torch.Generator().manual_seed(seed)
    out_features = panels * PANEL_WIDTH
    wide = torch.randn(rows, in_features + row_gap, generator=generator).to(dtype)
    x = wide[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    got = kernel_ops().panel_linear(x, panels_of(weight), bias)
    assert got.shape == (rows, out_features) and got.dtype == dtype and got.is_contiguous()
    within_bound(got, x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype):
    """Each row alone, and in batches of 5, 13 and 64 rows (other micro tile heights), gives the same bits."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(64, 576, generator=generator).to(dtype)
    weight = torch.randn(960, 576, generator=generator).to(dtype)
    panels = panels_of(weight)
    batch = kernel_ops().panel_linear(x, panels, None)
    for rows in (1, 5, 13):
        for start in range(0, 64 - rows + 1, rows):
            assert torch.equal(kernel_ops().panel_linear(x[start : start + rows], panels, None), batch[start : start + rows])


def test_panel_linear_refuses_what_it_cannot_read():
    ops = kernel_ops()
    x, weight = torch.randn(4, 64), torch.randn(64, 64)
    panels = panels_of(weight)
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.panel_linear(x.T.contiguous().T, panels, None)
    with pytest.raises(RuntimeError, match="\\[N / 32, K, 32\\]"):
        ops.panel_linear(x, weight, None)
    with pytest.raises(RuntimeError, match="share K"):
        ops.panel_linear(torch.randn(4, 63), panels, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.panel_linear(x.bfloat16(), panels, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.panel_linear(x.double(), panels.double(), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.panel_linear(x, panels, torch.randn(32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_takes_the_panels_for_few_rows_and_onednn_above(dtype):
    kernel_ops()
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    packed = pack_weight(weight)
    assert packed.panels is not None and packed.panel_rows == panel_rows(packed.panels)
    for rows in (1, packed.panel_rows, packed.panel_rows + 1, 200):
        x = torch.randn(rows, 80, generator=generator).to(dtype)
        got = packed_linear(x.view(1, rows, 80), packed, bias)
        assert got.shape == (1, rows, 96)
        if rows <= packed.panel_rows:
            want = kernel_ops().panel_linear(x, packed.panels, bias)
        elif packed.widened:
            want = torch.ops.mkldnn._linear_pointwise(x.float(), packed.onednn, bias.float(), "none", [], "").to(dtype)
        else:
            want = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
        assert torch.equal(got.view(rows, 96), want) and got.dtype == dtype
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got.view(rows, 96).float(), F.linear(x.float(), weight.float(), bias.float()), rtol=tolerance, atol=tolerance)


def test_weights_whose_outputs_do_not_fill_panels_run_on_onednn_only():
    weight = torch.randn(40, 16)
    packed = pack_weight(weight)
    assert packed.panels is None
    x = torch.randn(3, 16)
    torch.testing.assert_close(packed_linear(x, packed, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_bf16_panels_hold_pairs_where_the_cpu_has_bf16_dot_products():
    """This machine's library packs bf16 in pairs along K when the CPU has avx512_bf16 (and those panels
    then serve as many rows as float32 ones); an odd K is padded with a zero."""
    from build_kernels import cpu_flags

    panels = kernel_ops().pack_panels(torch.randn(64, 7).bfloat16())
    if "avx512_bf16" in cpu_flags() and "avx512f" in cpu_flags():
        assert panels.shape == (2, 4, 32, 2) and panel_rows(panels) == PANEL_ROWS
        assert torch.equal(panels[:, 3, :, 1], torch.zeros(2, 32, dtype=torch.bfloat16))
    else:
        assert panels.shape == (2, 7, 32) and panel_rows(panels) == WIDENED_BF16_ROWS


def test_bf16_linears_multiply_on_float32_copies_where_onednn_has_no_bf16_matmul():
    """Regression: on an AVX2-only CPU, packing a bf16 engine's linears raised in oneDNN's reorder (the
    engine could not load a bf16 model at all); then they ran on `F.linear`, 4.3x slower than float32
    served. Now their oneDNN copies are float32 there, and a call rounds back to bf16."""
    assert packs_linears(torch.device("cpu"), torch.bfloat16) is torch.backends.mkldnn.is_available()
    assert packs_linears(torch.device("cpu"), torch.float16) is False
    generator = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(96, 80, generator=generator).bfloat16(), torch.randn(96, generator=generator).bfloat16()
    packed = pack_weight(weight)
    assert packed.widened is not onednn_has_bf16_matmul()
    assert packed.onednn.dtype == (torch.float32 if packed.widened else torch.bfloat16)
    x = torch.randn(200, 80, generator=generator).bfloat16()  # above the panels' rows: oneDNN
    got = packed_linear(x, packed, bias)
    want = F.linear(x.float(), weight.float(), bias.float())  # every product exact in float32
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)


