"""Attention that also returns its log-sum-exp, so partial results over disjoint key sets can be merged.

For queries q, keys k_1..k_L and values v_1..v_L, with s_j = scale * q . k_j (+ an additive bias):

    out = sum_j softmax(s)_j v_j           lse = log sum_j exp(s_j)

Two partial results (out_a, lse_a) and (out_b, lse_b) over disjoint key sets A and B give the result over
A and B exactly: out = out_a + w (out_b - out_a) with w = exp(lse_b) / (exp(lse_a) + exp(lse_b)) =
sigmoid(lse_b - lse_a), which stays finite for any LSE values (see `merge_partials`).

`F.scaled_dot_product_attention` does not return the LSE; the kernels behind it do. Which one runs is
chosen once per runner (`choose_kernels`) and is explicit, never left to SDPA's dispatcher:

    CPU, unmasked calls    prefix_console::tiled_attention (engine/runner/csrc/tiled_attention.cpp): a prefill's
                           own tokens (causal) and many queries over a shared prefix, on register-blocked
                           tiles. Per layer on 2 cores, SmolLM2's shapes, inputs from memory, against the
                           flash kernel below (benchmarks/attention_kernels.py, fp32; bf16 faster still): a
                           cold 1,056-token prefill 10.3 ms vs 12.5, 8 / 64 decodes over a 1,024-token
                           prefix 265 / 1,052 us vs 327 / 1,198, 8 requests' 32 own tokens even.
    CPU, masked calls      aten::_scaled_dot_product_flash_attention_for_cpu: fp32/bf16/fp16, additive bias,
                           causal, grouped-query heads natively (also the unmasked kernel when the library
                           above is not built or refuses the head size). Measured on 2 cores: 0.12 ms for
                           8 decode queries over 1,024 keys, where matmul + logsumexp takes 0.18 ms and
                           FlexAttention without torch.compile 3.9 ms (30x).
    CUDA, bf16/fp16        unmasked and causal calls: aten::_scaled_dot_product_flash_attention (FlashAttention 2);
                           calls with a bias: aten::_scaled_dot_product_efficient_attention (memory-efficient).
    CUDA, fp32             aten::_scaled_dot_product_efficient_attention for every call (flash has no fp32).
    anything else          MATH: matmul + logsumexp in fp32 (also the fallback when a probe fails).

Decodes on the CPU have a kernel of their own (engine/runner/csrc/paged_decode.cpp, `attend_decodes`): one
query per element over that element's blocks, read in place from the cache, so a batch of decodes needs
no gather, no padding and no mask. The fused kernel above is built for many queries per key block; a
decode batch through it first copied every element's blocks into a padded buffer (64 decodes: 12 ms of
index_select per step) and then scored the padding. It is used when its library is built and loaded
(engine/runner/native_kernels.py) and its probe matches MATH; otherwise decodes take the padded, masked
call.

FlexAttention (a block mask built from block tables) was the alternative: on the CPU it needs
torch.compile to be usable, and on a GPU it compiles one kernel per mask shape family, which a step
whose batch shapes change every step would pay again and again; the fused kernels above need no
compilation and read gathered blocks at memory speed.

Every fused kernel is probed once against MATH on small inputs of the runner's dtype and head layout
(`choose_kernels`); one that raises or disagrees is replaced by MATH, and the reason is kept in
`KernelChoice.notes` for the device check to report.

Shapes: q [B, H, n, d]; k, v [B, KV, L, d] with H a multiple of KV (grouped-query attention, query head
h reads KV head h // (H / KV)); bias None or [B, 1, n or 1, L] additive in q's dtype (0 visible,
-inf hidden); `causal` only with n == L (query i sees keys 0..i). Returns out [B, H, n, d] in q's dtype
and lse [B, H, n] in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from engine.core.arith import ceil_div
from engine.runner.attention_plan import mask_bias
from engine.runner.native_kernels import load_ops


class Kernel(Enum):
    CPU_FLASH = "cpu-flash"  # aten::_scaled_dot_product_flash_attention_for_cpu
    CPU_TILED = "cpu-tiled"  # prefix_console::tiled_attention (unmasked calls only)
    CPU_PAGED_DECODE = "cpu-paged-decode"  # prefix_console::paged_decode (decodes only, K/V read in place)
    CUDA_FLASH = "cuda-flash"  # aten::_scaled_dot_product_flash_attention (bf16/fp16, no bias)
    CUDA_EFFICIENT = "cuda-efficient"  # aten::_scaled_dot_product_efficient_attention
    MATH = "math"  # matmul + logsumexp in fp32


@dataclass(frozen=True)
class KernelChoice:
    """The kernels one runner uses, by kind of call."""

    unmasked: Kernel  # calls without a bias (shared prefixes, causal own tokens, lone decodes)
    masked: Kernel  # calls with an additive bias (padded decode batches, windows, partial causality)
    notes: tuple[str, ...] = ()  # why a preferred kernel was replaced by MATH, or not used, if one was
    decodes: Kernel | None = None  # CPU_PAGED_DECODE: decodes read their blocks in place; None: a padded masked call

    def kernel(self, masked: bool) -> Kernel:
        return self.masked if masked else self.unmasked

    def summary(self) -> str:
        """One line for an operator: which kernel runs which calls, and why any fell back."""
        decodes = self.decodes.value if self.decodes is not None else f"{self.masked.value} (padded batch)"
        text = f"{self.unmasked.value}; masked calls {self.masked.value}; decodes {decodes}"
        return text + "".join(f"; {note}" for note in self.notes)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    bias: torch.Tensor | None = None,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp (shapes in the module docstring)."""
    if kernel is Kernel.CPU_FLASH:
        # Grouped-query heads natively; a call whose queries all see the same keys still runs faster with
        # each head group folded into the query axis (measured: 12 ms instead of 14 per 8-request decode
        # step over a 1,024-token prefix, SmolLM2): each KV head's keys are read by one task, not G.
        heads = HeadLayout.of(q, k, causal, bias)
        q = heads.fold_queries(q) if heads.fold else q
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return heads.restore(out, lse) if heads.fold else (out, lse)
    if kernel is Kernel.CPU_TILED:
        if bias is not None:
            raise ValueError("the tiled kernel takes no bias")
        ops, why_not = load_ops()
        if ops is None:
            raise RuntimeError(f"the tiled attention kernel is not available: {why_not}")
        return ops.tiled_attention(q, k, v, causal, scale)
    if kernel is Kernel.MATH:
        return _math(q, k, v, scale, causal, bias)
    return _cuda(q, k, v, scale, causal, bias, kernel)


def attend_decodes(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    fields: torch.Tensor,
    *,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention with its log-sum-exp, each element's keys read in place from its blocks.

    Args:
        q: [B, H, d], one query per element.
        key_cache, value_cache: one layer's [KV, N, block_size, d] block memory.
        blocks: [B, M] int64 physical blocks per element, in key order (padding: any block of the cache).
        fields: [B, 2 + M] int64 per element: query position, valid slots, the logical block of each block.
        window: the sliding window, or None.
        scale: softmax scale.

    Returns:
        out [B, H, d] in q's dtype and lse [B, H] in float32.
    """
    ops, why_not = load_ops()
    if ops is None:
        raise RuntimeError(f"the paged decode kernel is not available: {why_not}")
    return ops.paged_decode(q, key_cache, value_cache, blocks, fields, key_cache.shape[2], window or 0, scale)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """The attention output over two disjoint key sets from the two partial results, exactly.

    Args:
        out_a, out_b: [..., d] partial outputs (any float dtype; combined in float32).
        lse_a, lse_b: [...] their log-sum-exps (float32).

    Returns:
        [..., d] in out_a's dtype.
    """
    weight_b = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    if out_a.dtype == torch.float32 and out_b.dtype == torch.float32:
        return torch.lerp(out_a, out_b, weight_b)
    return torch.lerp(out_a.float(), out_b.float(), weight_b).to(out_a.dtype)


def merge_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """`merge_partials` written into out_a, in place (out_a may be a view of a larger output): on the CPU
    one pass of the library's `merge_partials_` (engine/runner/csrc/merge_partials.cpp), elsewhere the ops
    and a copy. lse_a is left as it was.

    Args:
        out_a: [R, H, d] results so far; out_b: [R, H, d] over the other keys.
        lse_a, lse_b: [R, H] their log-sum-exps (float32).
    """
    ops, _ = load_ops()
    if ops is not None and out_a.device.type == "cpu":
        ops.merge_partials_(out_a, lse_a, out_b, lse_b)
    else:
        out_a.copy_(merge_partials(out_a, lse_a, out_b, lse_b))


def choose_kernels(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> KernelChoice:
    """The preferred kernels for this device and dtype: for each kind of call the first candidate whose
    probe matches MATH (on the CPU, unmasked calls try the tiled kernel, then the flash kernel), else MATH."""
    if device.type == "cpu":
        candidates = ((Kernel.CPU_TILED, Kernel.CPU_FLASH), (Kernel.CPU_FLASH,))
    elif device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        candidates = ((Kernel.CUDA_FLASH,), (Kernel.CUDA_EFFICIENT,))
    elif device.type == "cuda":
        candidates = ((Kernel.CUDA_EFFICIENT,), (Kernel.CUDA_EFFICIENT,))
    else:
        return KernelChoice(Kernel.MATH, Kernel.MATH, (f"no fused kernel chosen for device {device.type}",))
    notes: list[str] = []
    shape = _ProbeShape(device, dtype, num_heads, num_kv_heads, head_dim)
    unmasked = _first_passing(candidates[0], False, shape, notes)
    masked = _first_passing(candidates[1], True, shape, notes)
    decodes = Kernel.CPU_PAGED_DECODE if device.type == "cpu" and _probe_decodes(shape, notes) else None
    return KernelChoice(unmasked, masked, tuple(notes), decodes)


def _first_passing(kernels: tuple[Kernel, ...], masked: bool, shape: _ProbeShape, notes: list[str]) -> Kernel:
    """The first of `kernels` whose probe matches MATH on this kind of call, else MATH."""
    return next((kernel for kernel in kernels if _probe(kernel, masked, shape, notes)), Kernel.MATH)


# Probe tolerance on outputs of magnitude ~1: a few units in the last place of the dtype's mantissa.
_PROBE_ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class _ProbeShape(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _probe(kernel: Kernel, masked: bool, shape: _ProbeShape, notes: list[str]) -> bool:
    """Run `kernel` on the call shapes the runner makes (decode batch, causal block, shared prefix) and compare."""
    device, dtype, num_heads, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(0)

    def rand(batch: int, length: int, heads: int) -> torch.Tensor:
        """[batch, heads, length, head_dim] as the runner passes it: a transposed view of rows of heads."""
        values = torch.randn(batch, length, heads, head_dim, generator=generator)
        return values.to(device=device, dtype=dtype).transpose(1, 2)

    cases = []
    if masked:  # a padded decode batch (odd key count) and a prefill chunk with partial causality
        for batch, queries, keys in ((3, 1, 37), (1, 5, 21)):
            visible = torch.rand(batch, 1, queries, keys, generator=generator) < 0.7
            visible[..., 0] = True
            bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).to(device=device, dtype=dtype)
            cases.append((batch, queries, keys, False, bias))
    else:  # own tokens, causal; queries of several requests over one shared prefix; a lone decode
        cases += [(2, 7, 7, True, None), (1, 9, 48, False, None), (1, 1, 30, False, None)]
    try:
        for batch, queries, keys, causal, bias in cases:
            q = rand(batch, queries, num_heads)
            k, v = rand(batch, keys, num_kv_heads), rand(batch, keys, num_kv_heads)
            out, lse = attend(q, k, v, scale=head_dim**-0.5, causal=causal, bias=bias, kernel=kernel)
            want_out, want_lse = _math(q, k, v, head_dim**-0.5, causal, bias)
            error = max((out.float() - want_out.float()).abs().max().item(), (lse - want_lse).abs().max().item())
            if not error <= _PROBE_ATOL.get(dtype, 5e-2):
                notes.append(f"{kernel.value} ({'masked' if masked else 'unmasked'}) differs from math by {error:.3g}")
                return False
    except (RuntimeError, NotImplementedError, AttributeError) as error:  # a kernel missing or refusing these shapes
        notes.append(f"{kernel.value} ({'masked' if masked else 'unmasked'}) unavailable: {str(error).splitlines()[0][:200]}")
        return False
    return True


def _probe_decodes(shape: _ProbeShape, notes: list[str]) -> bool:
    """Run the paged decode kernel on a batch with scattered blocks, padding, a partial last block and a
    window, and compare it with MATH over the same keys gathered and masked as the padded call masks them."""
    ops, why_not = load_ops()
    if ops is None:
        notes.append(f"{Kernel.CPU_PAGED_DECODE.value} unavailable: {why_not}")
        return False
    device, dtype, num_heads, num_kv_heads, head_dim = shape
    block_size, num_blocks = 4, 12
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=generator).to(device=device, dtype=dtype)
    q = torch.randn(3, num_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    # per element: physical blocks (padded to 3 with its first); query position, valid slots, logical blocks
    blocks = torch.tensor([[7, 2, 9], [5, 5, 5], [3, 11, 3]], device=device)
    fields = torch.tensor([[10, 11, 0, 1, 2], [2, 3, 0, 0, 0], [21, 6, 4, 5, 4]], device=device)
    num_keys = blocks.shape[1] * block_size
    # the padded call's keys: each element's blocks gathered, [B, KV, num_keys, d]
    k, v = (c[:, blocks].permute(1, 0, 2, 3, 4).reshape(3, num_kv_heads, num_keys, head_dim) for c in cache)
    try:
        for window in (None, 5):
            out, lse = ops.paged_decode(q, cache[0], cache[1], blocks, fields, block_size, window or 0, head_dim**-0.5)
            bias = mask_bias(fields, 1, num_keys, block_size, window, dtype)  # the padded call's mask
            want_out, want_lse = _math(q.unsqueeze(2), k, v, head_dim**-0.5, False, bias)
            error = max((out.float() - want_out[:, :, 0].float()).abs().max().item(), (lse - want_lse[:, :, 0]).abs().max().item())
            if not error <= _PROBE_ATOL.get(dtype, 5e-2):
                notes.append(f"{Kernel.CPU_PAGED_DECODE.value} differs from math by {error:.3g}")
                return False
    except RuntimeError as error:  # the kernel refusing these shapes or this dtype
        notes.append(f"{Kernel.CPU_PAGED_DECODE.value} unavailable: {str(error).splitlines()[0][:200]}")
        return False
    return True


def _math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        n = q.shape[2]
        hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out.to(q.dtype), lse


# ---------------------------------------------------------------------------------------------- CUDA
# Neither CUDA kernel is called with fewer KV heads than query heads (`HeadLayout`). The memory-efficient
# kernel wants its bias's rows 16-element aligned (as SDPA's own `pad_bias` ensures) and pads its LSE to a
# multiple of 32 queries; both are handled here.
_BIAS_ALIGN = 16


def _cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, bias: torch.Tensor | None, kernel: Kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel is Kernel.CUDA_FLASH and bias is not None:
        raise ValueError("the flash kernel takes no bias")
    heads = HeadLayout.of(q, k, causal, bias)
    q, k, v, bias = heads.apply(q, k, v, None if bias is None else _aligned(bias))
    if kernel is Kernel.CUDA_FLASH:
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = result[0], result[1]
    else:
        result = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
        out, lse = result[0], result[1][..., : q.shape[2]]
    return heads.restore(out, lse.float())


@dataclass(frozen=True)
class HeadLayout:
    """How a call is reshaped for a kernel that needs as many KV heads as query heads.

    A call whose queries all see the same keys (no causality, a bias without a query axis) folds each
    group of G query heads into the query axis: q [B, KV * G, n, d] -> [B, KV, G * n, d], K/V untouched.
    Any other call repeats each KV head G times.
    """

    shape: tuple[int, int, int, int]  # q's original [B, H, n, d]
    group: int  # G: query heads per KV head
    fold: bool  # fold (True) or repeat K/V (False); no change when group == 1

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool, bias: torch.Tensor | None) -> HeadLayout:
        group = q.shape[1] // k.shape[1]
        return cls(tuple(q.shape), group, group > 1 and not causal and (bias is None or bias.shape[2] == 1))

    def fold_queries(self, q: torch.Tensor) -> torch.Tensor:
        batch, heads, n, head_dim = self.shape
        return q.reshape(batch, heads // self.group, self.group * n, head_dim)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v with equal head counts, and the bias expanded to [B, heads, queries, L]."""
        batch = self.shape[0]
        if self.fold:
            q = self.fold_queries(q)
        elif self.group > 1:
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        if bias is not None:
            bias = bias.expand(batch, q.shape[1], q.shape[2], bias.shape[-1])
        return q, k, v, bias

    def restore(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's out and lse back in the caller's [B, H, n, d] and [B, H, n]."""
        return out.reshape(self.shape), lse.reshape(self.shape[:3])


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """The same bias in storage whose rows start at multiples of 16 elements."""
    length = bias.shape[-1]
    if length % _BIAS_ALIGN == 0 and bias.is_contiguous():
        return bias
    padded = bias.new_zeros(*bias.shape[:-1], ceil_div(length, _BIAS_ALIGN) * _BIAS_ALIGN)
    padded[..., :length] = bias
    return padded[..., :length]
