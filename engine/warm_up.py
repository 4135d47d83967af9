"""A throwaway forward that pays a first forward's one-time costs before the first request does.

Kernel and thread-pool start-up and the allocator growing to a forward's working set cost the first
forward of a process; `warm_up` runs a prefill and a one-token decode on made-up tokens so that no
request pays them.

Invariant: both forwards write their K/V only to the runner's scratch slots and read blocks no request
holds (the caller checks that none holds any): no block, table, request, counter or event changes, and no
later output differs.
"""

from __future__ import annotations

from engine.core.admission import ModelLimits
from engine.core.arith import ceil_div
from engine.runner.model_runner import GroupSlots, ModelRunner, SeqChunk

WARM_UP_TOKENS = 256  # prefill length of `warm_up`: about a typical prompt


def warm_up(runner: ModelRunner, num_blocks: int, block_size: int, limits: ModelLimits, num_tokens: int) -> None:
    """Prefill `num_tokens` made-up tokens (fewer where the pool or the model's positions hold fewer), then
    decode one, over blocks [0, n) of pools of `num_blocks` that no request holds."""
    num_tokens = max(1, min(num_tokens, num_blocks * block_size - 1, limits.max_model_len - 1))
    blocks = list(range(min(num_blocks, ceil_div(num_tokens + 1, block_size))))
    tokens = [i % limits.vocab_size for i in range(num_tokens + 1)]
    for start, end in ((0, num_tokens), (num_tokens, num_tokens + 1)):
        groups = tuple(GroupSlots(blocks, 0, end) for _ in runner.groups)  # write_from = end: scratch only
        runner.execute([SeqChunk(tokens[start:end], start, groups)])
