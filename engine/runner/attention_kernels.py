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
and its probe matches MATH; otherwise decodes take the padded, masked call.

FlexAttention (a block mask built from block tables) was the alternative: on the CPU it needs
torch.compile to be usable, and on a GPU it compiles one kernel per mask shape family, which a step
whose batch shapes change every step would pay again and again; the fused kernels above need no
compilation and read gathered blocks at memory speed.

Every fused kernel is probed once against MATH on small inputs of the runner's dtype and head layout
(`choose_kernels`): the library's (tiled, paged decode, merge) by engine/runner/native_kernels.py, which
owns the library, with one probe per op; torch's and CUDA's here, over the same calls
(`kernel_probes.attention_error`). One that raises or disagrees is replaced by the next candidate or
MATH, and the reason is kept in `KernelChoice.notes` for the Settings page and the device check.

Shapes: q [B, H, n, d]; k, v [B, KV, L, d] with H a multiple of KV (grouped-query attention, query head
h reads KV head h // (H / KV)); bias None or [B, 1, n or 1, L] additive in q's dtype (0 visible,
-inf hidden); `causal` only with n == L (query i sees keys 0..i). Returns out [B, H, n, d] in q's dtype
and lse [B, H, n] in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from engine.core.arith import ceil_div
from engine.runner.attention_reference import math_attention, merge_partials
from engine.runner.kernel_probes import ProbeCase, attention_error
from engine.runner.native_kernels import load_ops, probe, probe_note, probe_notes


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
        return math_attention(q, k, v, scale, causal, bias)
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


def merge_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """`merge_partials` written into out_a, in place (out_a may be a view of a larger output): on the CPU
    one pass of the library's `merge_partials_` (engine/runner/csrc/merge_partials.cpp), elsewhere the ops
    and a copy. lse_a is left as it was.

    Args:
        out_a: [R, H, d] results so far; out_b: [R, H, d] over the other keys.
        lse_a, lse_b: [R, H] their log-sum-exps (float32).
    """
    merge = probe("merge_partials_", ProbeCase.tiny(out_a.dtype)) if out_a.device.type == "cpu" else None
    if merge is not None and merge.passed:
        merge.ops.merge_partials_(out_a, lse_a, out_b, lse_b)
    else:
        out_a.copy_(merge_partials(out_a, lse_a, out_b, lse_b))


def choose_kernels(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> KernelChoice:
    """The preferred kernels for this device and dtype: for each kind of call the first candidate whose
    probe matches MATH (on the CPU, unmasked calls try the library's tiled kernel, then the flash kernel),
    else MATH; on the CPU, decodes in place where the paged decode kernel's probe passes.

    Raises:
        StaleKernelLibraryError: on the CPU, the kernel library is stale (engine/runner/native_kernels.py).
    """
    if device.type == "cpu":
        candidates = ((Kernel.CPU_TILED, Kernel.CPU_FLASH), (Kernel.CPU_FLASH,))
    elif device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        candidates = ((Kernel.CUDA_FLASH,), (Kernel.CUDA_EFFICIENT,))
    elif device.type == "cuda":
        candidates = ((Kernel.CUDA_EFFICIENT,), (Kernel.CUDA_EFFICIENT,))
    else:
        return KernelChoice(Kernel.MATH, Kernel.MATH, (f"no fused kernel chosen for device {device.type}",))
    case = ProbeCase(dtype, num_heads, num_kv_heads, head_dim)
    notes = []
    if device.type == "cpu":  # the library's ops; merges are probed at one small layout (`merge_into`)
        library = probe_notes(("tiled_attention", "paged_decode"), case) + probe_notes(("merge_partials_",), ProbeCase.tiny(dtype))
        notes += dict.fromkeys(library)  # once each: a library not built gives each call the same reason
    unmasked = _first_passing(candidates[0], False, device, case, notes)
    masked = _first_passing(candidates[1], True, device, case, notes)
    decodes = Kernel.CPU_PAGED_DECODE if device.type == "cpu" and probe("paged_decode", case).passed else None
    return KernelChoice(unmasked, masked, tuple(notes), decodes)


# The kernels that are ops of the engine's library, each probed by engine/runner/native_kernels.py.
_LIBRARY_KERNELS = {Kernel.CPU_TILED: "tiled_attention"}


def _first_passing(kernels: tuple[Kernel, ...], masked: bool, device: torch.device, case: ProbeCase, notes: list[str]) -> Kernel:
    """The first of `kernels` whose probe matches MATH on this kind of call, else MATH."""
    return next((kernel for kernel in kernels if _passes(kernel, masked, device, case, notes)), Kernel.MATH)


def _passes(kernel: Kernel, masked: bool, device: torch.device, case: ProbeCase, notes: list[str]) -> bool:
    """Whether `kernel` matches MATH on the calls the runner makes of this kind: the library's through its
    own probe (its note already taken), torch's and CUDA's here (a failure noted)."""
    if kernel in _LIBRARY_KERNELS:
        return probe(_LIBRARY_KERNELS[kernel], case).passed

    def call(q, k, v, scale, causal, bias):
        return attend(q, k, v, scale=scale, causal=causal, bias=bias, kernel=kernel)

    label = f"{kernel.value} ({'masked' if masked else 'unmasked'})"
    note = probe_note(label, lambda: attention_error(call, case, masked, device), case.dtype)
    if note is not None:
        notes.append(note)
    return note is None


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
