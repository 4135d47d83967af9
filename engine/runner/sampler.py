"""Next-token choice from last-position logits: greedy at temperature 0, else temperature + top-p.

Sampling runs on the CPU with each request's own generator, so a seeded request draws the same tokens
whatever device computed its logits and whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.request import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [n, vocab] float logits, one row per request.
        params: the sampling parameters of each row.
        generators: each row's CPU generator (None draws from the global CPU generator); unused
            by greedy rows.

    Returns:
        n token ids.
    """
    if not logits.shape[0] == len(params) == len(generators):
        raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, {len(generators)} generators")
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        rows = logits[sampled].float().cpu()
        for row, i in zip(rows, sampled):
            tokens[i] = _sample_row(row, params[i], generators[i])
    return tokens


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw from softmax(logits / temperature) restricted to the smallest top-p nucleus."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep a token while the mass before it is below top_p: the most likely token always stays.
    keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p
    nucleus = sorted_probs * keep
    choice = torch.multinomial(nucleus / nucleus.sum(), 1, generator=generator)
    return int(order[choice])
