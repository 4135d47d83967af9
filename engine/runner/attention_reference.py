"""Attention and the merge of partial results in plain torch ops: the reference every fused kernel is
probed against (engine/runner/kernel_probes.py), and the MATH kernel and merge that run where no fused
one does (engine/runner/attention_kernels.py).

Shapes as in attention_kernels: q [B, H, n, d]; k, v [B, KV, L, d] with H a multiple of KV; bias None or
additive [B, 1, n or 1, L]; `causal` only with n == L. `math_attention` computes in float32 whatever the
inputs' dtype and returns out in q's dtype and lse in float32.
"""

from __future__ import annotations

import torch


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp by matmul + logsumexp in float32."""
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
