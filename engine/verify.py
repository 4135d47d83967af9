"""Measuring how far an approximate window replay drifted from a from-scratch computation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Divergence:
    """Per-token comparison of the logits a request sampled from against a from-scratch forward."""

    num_tokens: int  # output tokens compared
    max_abs_logit: float  # max |logit - reference logit| over all compared tokens and the vocabulary
    mean_kl: float  # mean KL(reference || replayed) in nats
    max_kl: float
    top1_agreement: float  # fraction of tokens whose argmax agrees with the reference

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def divergence(replayed: torch.Tensor, reference: torch.Tensor) -> Divergence:
    """Compare [n, vocab] logits row by row (the same positions, teacher-forced on the same tokens)."""
    if replayed.shape != reference.shape or replayed.shape[0] == 0:
        raise ValueError(f"need two equal non-empty [n, vocab] tensors, got {tuple(replayed.shape)}, {tuple(reference.shape)}")
    replayed, reference = replayed.float(), reference.float()
    log_p = torch.log_softmax(reference, dim=-1)
    log_q = torch.log_softmax(replayed, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return Divergence(
        num_tokens=replayed.shape[0],
        max_abs_logit=(replayed - reference).abs().max().item(),
        mean_kl=kl.mean().item(),
        max_kl=kl.max().item(),
        top1_agreement=(replayed.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    )
