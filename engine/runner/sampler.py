"""Next-token choice from last-position logits: greedy at temperature 0, else temperature + top-p.

Sampling runs on the CPU with each request's own generator, so a seeded request draws the same tokens
whatever device computed its logits and whatever else shares its batch.

Before a token is picked, a row whose `SamplingParams.adjusts_logits` is adjusted as vLLM does: its
`logit_bias` is added, then the presence penalty is subtracted from every token its output holds and the
frequency penalty once per occurrence (the output so far only, not the prompt). Greedy rows then take the
argmax of the adjusted row; rows without adjustments take the argmax of the logits as given, so their
tokens are exactly what they were before adjustments existed.

Logprobs (`token_logprobs`) are of the raw distribution, log_softmax of the model's logits before bias,
penalties, temperature and top-p: vLLM's default (`logprobs_mode="raw_logprobs"`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.request import SamplingParams, TokenLogprobs


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    outputs: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [n, vocab] float logits, one row per request.
        params: the sampling parameters of each row.
        generators: each row's CPU generator (None draws from the global CPU generator); unused
            by greedy rows.
        outputs: each row's output tokens so far, which the penalties count; None when no row has one.

    Returns:
        n token ids.

    Raises:
        ValueError: the rows, params, generators (and outputs) do not pair up, or a row has penalties
            and no outputs were given.
    """
    if not logits.shape[0] == len(params) == len(generators):
        raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, {len(generators)} generators")
    if outputs is not None and len(outputs) != len(params):
        raise ValueError(f"{len(outputs)} outputs for {len(params)} rows")
    tokens = logits.argmax(dim=-1).tolist()
    chosen = [i for i, p in enumerate(params) if p.temperature > 0 or p.adjusts_logits]
    if chosen:
        rows = logits[chosen].float().cpu()
        for row, i in zip(rows, chosen):
            if params[i].adjusts_logits:
                row = _adjusted(row, params[i], _output_of(outputs, i, params[i]))
            if params[i].temperature > 0:
                tokens[i] = _sample_row(row, params[i], generators[i])
            else:
                tokens[i] = int(row.argmax())
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Each row's chosen token's logprob and its `num_top[i]` most likely tokens, of the raw logits.

    Args:
        logits: [n, vocab] logits as the model gave them.
        tokens: the token chosen in each row.
        num_top: how many of the most likely tokens to report for each row (0 to 20).
    """
    if not logits.shape[0] == len(tokens) == len(num_top):
        raise ValueError(f"{logits.shape[0]} logits rows, {len(tokens)} tokens, {len(num_top)} counts")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(num_top, default=0)
    if k == 0:
        return [TokenLogprobs(float(lp), ()) for lp in chosen]
    values, ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    return [
        TokenLogprobs(float(lp), tuple(zip(row_ids[:n], row_values[:n])))
        for lp, row_ids, row_values, n in zip(chosen, ids, values, num_top)
    ]


def _output_of(outputs: Sequence[Sequence[int]] | None, i: int, params: SamplingParams) -> Sequence[int]:
    if outputs is None:
        if params.presence_penalty or params.frequency_penalty:
            raise ValueError("a row with penalties needs its output tokens")
        return ()
    return outputs[i]


def _adjusted(logits: torch.Tensor, params: SamplingParams, output: Sequence[int]) -> torch.Tensor:
    """The row with its logit bias added and its penalties subtracted (a new tensor)."""
    row = logits.clone()
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias])
        row[ids] += torch.tensor([bias for _, bias in params.logit_bias], dtype=row.dtype)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.unique(torch.tensor(list(output)), return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
    return row


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw from softmax(logits / temperature) restricted to the smallest top-p nucleus."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep a token while the mass before it is below top_p: the most likely token always stays.
    keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p
    nucleus = sorted_probs * keep
    choice = torch.multinomial(nucleus / nucleus.sum(), 1, generator=generator)
    return int(order[choice])
