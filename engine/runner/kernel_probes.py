"""One probe per op of the engine's kernel library: the op on tiny inputs against plain torch ops.

A probe runs its op on the shapes its callers make, at the probed dtype and head layout (`ProbeCase`), and
returns its largest error against the torch reference, relative to the reference's magnitude (at least 1).
A probe that raises (the op refusing the shapes or the dtype) fails like one over `tolerance`.
engine/runner/native_kernels.py runs each probe once per case before the op's first use; nothing here
loads the library or decides anything.

    op                         reference
    tiled_attention            matmul + logsumexp: own tokens causally, queries over a shared prefix, a lone decode
    paged_decode               matmul + logsumexp over the blocks gathered and masked as the padded call does
    merge_partials_            `merge_partials` (sigmoid of the LSE difference, lerp)
    rms_norm, add_rms_norm_,
    silu_and_mul, rope_        a decoder layer's torch steps (engine/runner/layer_steps.py)
    panel_linear               F.linear over the weight the panels were packed from (pack_panels with it)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from engine.runner import layer_steps
from engine.runner.attention_plan import mask_bias
from engine.runner.attention_reference import math_attention, merge_partials

# Largest relative error a probe passes with: a few units in the last place of the dtype's mantissa.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}

# (q, k, v, scale, causal, bias) -> (out, lse), as attention_kernels.attend's kernels take them
AttentionCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, bool, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


class ProbeCase(NamedTuple):
    """What an op is probed on: its callers' dtype and (for attention) the runner's head layout."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def tiny(cls, dtype: torch.dtype) -> ProbeCase:
        """A small layout for the ops whose shapes do not come from the model's heads (merges, linears)."""
        return cls(dtype, 4, 2, 16)


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative error a probe at this dtype passes with."""
    return _TOLERANCE.get(dtype, 5e-2)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max(1, max |want|), in float32."""
    want = want.float()
    return (got.float() - want).abs().max().item() / max(1.0, want.abs().max().item())


def attention_error(call: AttentionCall, case: ProbeCase, masked: bool, device: torch.device) -> float:
    """The largest error of an attention call against MATH over the calls the runner makes of its kind:
    masked, a padded decode batch (odd key count) and a prefill chunk with partial causality; unmasked,
    own tokens causally, queries of several requests over one shared prefix and a lone decode."""
    dtype, num_heads, num_kv_heads, head_dim = case
    generator = torch.Generator().manual_seed(0)

    def rand(batch: int, length: int, heads: int) -> torch.Tensor:
        """[batch, heads, length, head_dim] as the runner passes it: a transposed view of rows of heads."""
        values = torch.randn(batch, length, heads, head_dim, generator=generator)
        return values.to(device=device, dtype=dtype).transpose(1, 2)

    cases = []
    if masked:
        for batch, queries, keys in ((3, 1, 37), (1, 5, 21)):
            visible = torch.rand(batch, 1, queries, keys, generator=generator) < 0.7
            visible[..., 0] = True
            bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).to(device=device, dtype=dtype)
            cases.append((batch, queries, keys, False, bias))
    else:
        cases += [(2, 7, 7, True, None), (1, 9, 48, False, None), (1, 1, 30, False, None)]
    error = 0.0
    for batch, queries, keys, causal, bias in cases:
        q = rand(batch, queries, num_heads)
        k, v = rand(batch, keys, num_kv_heads), rand(batch, keys, num_kv_heads)
        out, lse = call(q, k, v, head_dim**-0.5, causal, bias)
        want_out, want_lse = math_attention(q, k, v, head_dim**-0.5, causal, bias)
        error = max(error, relative_error(out, want_out), relative_error(lse, want_lse))
    return error


def _tiled_attention(ops: Any, case: ProbeCase) -> float:
    def call(q, k, v, scale, causal, bias):
        return ops.tiled_attention(q, k, v, causal, scale)

    return attention_error(call, case, masked=False, device=torch.device("cpu"))


def _paged_decode(ops: Any, case: ProbeCase) -> float:
    """A batch with scattered blocks, padding, a partial last block and a window, against MATH over the same
    keys gathered and masked as the padded call masks them."""
    dtype, num_heads, num_kv_heads, head_dim = case
    block_size, num_blocks = 4, 12
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=generator).to(dtype)
    q = torch.randn(3, num_heads, head_dim, generator=generator).to(dtype)
    # per element: physical blocks (padded to 3 with its first); query position, valid slots, logical blocks
    blocks = torch.tensor([[7, 2, 9], [5, 5, 5], [3, 11, 3]])
    fields = torch.tensor([[10, 11, 0, 1, 2], [2, 3, 0, 0, 0], [21, 6, 4, 5, 4]])
    num_keys = blocks.shape[1] * block_size
    # the padded call's keys: each element's blocks gathered, [B, KV, num_keys, d]
    k, v = (c[:, blocks].permute(1, 0, 2, 3, 4).reshape(3, num_kv_heads, num_keys, head_dim) for c in cache)
    error = 0.0
    for window in (None, 5):
        out, lse = ops.paged_decode(q, cache[0], cache[1], blocks, fields, block_size, window or 0, head_dim**-0.5)
        bias = mask_bias(fields, 1, num_keys, block_size, window, dtype)  # the padded call's mask
        want_out, want_lse = math_attention(q.unsqueeze(2), k, v, head_dim**-0.5, False, bias)
        error = max(error, relative_error(out, want_out[:, :, 0]), relative_error(lse, want_lse[:, :, 0]))
    return error


def _merge_partials(ops: Any, case: ProbeCase) -> float:
    generator = torch.Generator().manual_seed(0)
    rows, heads, head_dim = 3, case.num_heads, case.head_dim
    out_a, out_b = (torch.randn(rows, heads, head_dim, generator=generator).to(case.dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(rows, heads, generator=generator) * 4 for _ in range(2))
    want = merge_partials(out_a, lse_a, out_b, lse_b)
    ops.merge_partials_(out_a, lse_a, out_b, lse_b)
    return relative_error(out_a, want)


def _decoder_inputs(case: ProbeCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden, delta [5, heads * head_dim] and a positive norm weight, at the case's dtype."""
    generator = torch.Generator().manual_seed(0)
    width = case.num_heads * case.head_dim
    hidden, delta = (torch.randn(5, width, generator=generator).to(case.dtype) for _ in range(2))
    return hidden * 3, delta, (torch.rand(width, generator=generator) + 0.5).to(case.dtype)


def _rms_norm(ops: Any, case: ProbeCase) -> float:
    hidden, _, weight = _decoder_inputs(case)
    return relative_error(ops.rms_norm(hidden, weight, 1e-5), layer_steps.rms_norm(hidden, weight, 1e-5))


def _add_rms_norm(ops: Any, case: ProbeCase) -> float:
    hidden, delta, weight = _decoder_inputs(case)
    want_hidden, want_normed = layer_steps.add_rms_norm(hidden, delta, weight, 1e-5)
    got_normed = ops.add_rms_norm_(hidden, delta, weight, 1e-5)  # adds into hidden
    return max(relative_error(hidden, want_hidden), relative_error(got_normed, want_normed))


def _silu_and_mul(ops: Any, case: ProbeCase) -> float:
    hidden, delta, _ = _decoder_inputs(case)
    gate_up = torch.cat([hidden, delta], dim=-1)
    return relative_error(ops.silu_and_mul(gate_up), layer_steps.silu_and_mul(hidden, delta))


def _rope(ops: Any, case: ProbeCase) -> float:
    generator = torch.Generator().manual_seed(0)
    rows, heads, head_dim = 5, case.num_heads + case.num_kv_heads, case.head_dim
    qk = torch.randn(rows, heads, head_dim, generator=generator).to(case.dtype)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 6
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(case.dtype) for f in (torch.cos, torch.sin))
    want = layer_steps.rope(qk, cos, sin)
    ops.rope_(qk, cos, sin)  # rotates qk in place
    return relative_error(qk, want)


def _panel_linear(ops: Any, case: ProbeCase) -> float:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 40, generator=generator).to(case.dtype)
    bias = torch.randn(64, generator=generator).to(case.dtype)
    panels = ops.pack_panels(weight)
    error = 0.0
    for rows in (1, 3):
        x = torch.randn(rows, 40, generator=generator).to(case.dtype)
        want = F.linear(x.float(), weight.float(), bias.float())
        error = max(error, relative_error(ops.panel_linear(x, panels, bias), want))
    return error


# op name -> its probe: (the library's ops, the case) -> largest relative error against the reference
PROBES: dict[str, Callable[[Any, ProbeCase], float]] = {
    "tiled_attention": _tiled_attention,
    "paged_decode": _paged_decode,
    "merge_partials_": _merge_partials,
    "rms_norm": _rms_norm,
    "add_rms_norm_": _add_rms_norm,
    "silu_and_mul": _silu_and_mul,
    "rope_": _rope,
    "panel_linear": _panel_linear,
}
