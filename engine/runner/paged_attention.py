"""Paged attention for one layer of one packed forward: write the tokens' K/V, then run the step's plan.

The model runner (engine/runner/model_runner.py) builds a `PagedContext` once per step: the block memory,
the slot each packed token writes, and per KV group the kernel calls planned on the host
(engine/runner/attention_plan.py). Every attention layer then calls `attend_paged`, directly from
engine/runner/decoder_forward.py or through `paged_attention`, the transformers attention function the
runner registers as `PAGED_ATTENTION`. In each layer the new K/V of all tokens is written into their slots
first, then the calls run: decodes over their blocks in place, chunks over their own fresh K/V, a run of
consecutive blocks as a view, other blocks gathered into the step's buffer, and shared leading blocks once
for the chunks that share them, merged into each chunk's own result by log-sum-exp (cascade attention).

Invariant the runner keeps: no two chunks of one step write the same slot, and no chunk reads a slot
another chunk of the step writes, so writing every token's K/V before any read is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runner.attention_kernels import KernelChoice, attend, attend_decodes, merge_into, merge_partials
from engine.runner.attention_plan import AttentionCall, KeySource

PAGED_ATTENTION = "prefix_console_paged"  # the name `paged_attention` is registered under with transformers


@dataclass(frozen=True)
class PagedContext:
    """Everything the attention function needs for one forward; passed as the `paged_context` kwarg."""

    kv: tuple[torch.Tensor, ...]  # per KV group: its block memory (last block: scratch)
    layers: tuple[tuple[int, int], ...]  # per model layer: (KV group, layer index within the group)
    windows: tuple[int | None, ...]  # per KV group: None (full) or the sliding window
    slots: tuple[torch.Tensor, ...]  # per KV group: [T] cache slot every packed token writes
    calls: tuple[tuple[AttentionCall, ...], ...]  # per KV group: the kernel calls, shared (merging) ones last
    # per KV group: the calls of a layer whose output is wanted only at each chunk's last token (its query
    # alone, as a decode); None when every chunk is one token (the same calls)
    last_token_calls: tuple[tuple[AttentionCall, ...], ...] | None
    kernels: KernelChoice  # which kernel runs unmasked, masked and decode calls
    gather: tuple[torch.Tensor, torch.Tensor]  # flat K and V buffers the gathers of every layer reuse
    lse: torch.Tensor  # [T, num_heads] float32: each row's partial log-sum-exp, rewritten by every layer


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    paged_context: PagedContext,
    scaling: float,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """`attend_paged` as a transformers attention function (the `AttentionInterface` signature).

    Args:
        module: the attention module; its `layer_idx` selects the cache layer and window.
        query: [1, num_heads, T, head_dim] for the packed tokens.
        key: [1, num_kv_heads, T, head_dim], written into the cache before any read.
        value: like `key`.
        attention_mask: ignored (always None: no mask function is registered for this implementation).
        paged_context: the plan built by `ModelRunner.execute`.
        scaling: softmax scale.
        **kwargs: other transformers kwargs; a `sliding_window` the model passes must match the plan.

    Returns:
        ([1, T, num_heads, head_dim] attention output, None).
    """
    g = paged_context.layers[module.layer_idx][0]
    window = paged_context.windows[g]
    if kwargs.get("sliding_window", window) != window:
        raise RuntimeError(f"layer {module.layer_idx}: model window {kwargs['sliding_window']} != attention spec {window}")
    rows_first = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    return attend_paged(paged_context, module.layer_idx, *rows_first, scaling).unsqueeze(0), None


def attend_paged(
    paged_context: PagedContext,
    layer: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    last_tokens_only: bool = False,
) -> torch.Tensor:
    """Attention over paged K/V for one layer: write the packed tokens' K/V into their slots, then run
    the plan's kernel calls.

    Args:
        paged_context: the plan built by `ModelRunner.execute`.
        layer: the model layer (selects its KV group, cache layer and window).
        queries: [T, num_heads, head_dim] for the packed tokens.
        keys: [T, num_kv_heads, head_dim], written into the cache before any read.
        values: like `keys`.
        scaling: softmax scale.
        last_tokens_only: only each chunk's last token needs its output: that token's query alone runs,
            as a decode (every token's K/V is still written); the other rows are left unset.

    Returns:
        [T, num_heads, head_dim] attention output.
    """
    g, local = paged_context.layers[layer]
    key_cache, value_cache = paged_context.kv[g][local]
    slots = paged_context.slots[g]
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[-1]
    key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, keys.transpose(0, 1))
    value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, values.transpose(0, 1))

    num_heads = queries.shape[1]
    output = torch.empty(queries.shape, dtype=queries.dtype, device=queries.device)
    lse = paged_context.lse
    every_token = not last_tokens_only or paged_context.last_token_calls is None
    for call in (paged_context.calls if every_token else paged_context.last_token_calls)[g]:
        n, rows = call.num_queries, call.rows
        if call.keys is KeySource.PAGED:  # decodes, each over its own blocks in place
            attended, partial_lse = attend_decodes(
                _take_rows(queries, rows), key_cache, value_cache, call.blocks, call.fields,
                window=paged_context.windows[g], scale=scaling,
            )  # fmt: skip
            _put_rows(lse, rows, partial_lse)
            _put_rows(output, rows, attended)
            continue
        q = _take_rows(queries, rows).view(-1, n, num_heads, head_dim).transpose(1, 2)
        if call.keys is KeySource.OWN:  # the chunks' own tokens: read the fresh K/V, no gather
            k, v = (_take_rows(fresh, rows).view(-1, n, num_kv_heads, head_dim).transpose(1, 2) for fresh in (keys, values))
        elif call.keys is KeySource.VIEW:  # consecutive blocks: read in place
            k, v = (
                cache[:, call.blocks].view(1, num_kv_heads, -1, head_dim)[:, :, : call.num_keys]
                for cache in (key_cache, value_cache)
            )
        else:
            k, v = (
                _gather_blocks(cache, call.blocks, buffer)
                .view(num_kv_heads, q.shape[0], -1, head_dim)[:, :, : call.num_keys]
                .transpose(0, 1)
                for cache, buffer in zip((key_cache, value_cache), paged_context.gather)
            )
        kernel = paged_context.kernels.kernel(masked=call.bias is not None)
        attended, partial_lse = attend(q, k, v, scale=scaling, causal=call.causal, bias=call.bias, kernel=kernel)
        attended = attended.transpose(1, 2).reshape(-1, num_heads, head_dim)
        partial_lse = partial_lse.transpose(1, 2).reshape(-1, num_heads)
        if call.merges and isinstance(rows, slice):  # a shared prefix: merge into the rows' private results
            merge_into(output[rows], lse[rows], attended, partial_lse)
            continue
        if call.merges:
            attended = merge_partials(_take_rows(output, rows), _take_rows(lse, rows), attended, partial_lse)
        else:
            _put_rows(lse, rows, partial_lse)
        _put_rows(output, rows, attended)
    return output


def _take_rows(tensor: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def _put_rows(tensor: torch.Tensor, rows: slice | torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(rows, slice):
        tensor[rows] = values
    else:
        tensor.index_copy_(0, rows, values)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`cache[:, block_ids]` as [kv_head, block, slot * head_dim], written into the front of `buffer`
    (overwritten by the next gather)."""
    num_kv_heads, block_numel = cache.shape[0], cache.shape[2] * cache.shape[3]
    out = buffer[: num_kv_heads * block_ids.numel() * block_numel].view(num_kv_heads, block_ids.numel(), block_numel)
    return torch.index_select(cache.view(num_kv_heads, -1, block_numel), 1, block_ids, out=out)
