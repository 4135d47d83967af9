"""The torch side of the engine: the KV block memory and one packed forward per step.

The runner knows block ids and positions, never requests, hashes or tokenization. Memory is allocated
once::

    kv[layer, 0 = K | 1 = V, block, slot, kv_head, head_dim]

    position p of a sequence -> block_table[p // block_size], slot p % block_size

`execute` packs the tokens of every chunk into one sequence (batch 1, per-token position ids) and runs
the transformers model with a paged attention function registered through `AttentionInterface`; the
per-step plan travels to it through the forward's keyword arguments. In each layer the function first
writes the new K/V of all tokens into their slots, then, per batch of chunks, gathers the K/V of the
positions the batch can see from its blocks and calls SDPA. A prefill chunk is a batch of its own; all
single-token (decode) chunks form one padded batch. Layers are split into KV groups (full and sliding,
engine/kv_groups.py), each with its own block memory and tables. Only the last token of each chunk reaches the LM head.

Invariants the caller keeps: no two chunks in one call write the same slot, and no chunk reads a slot
another chunk of the same call writes (copy-on-write happens before, through `copy_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.kv_coordinator import GroupSlots
from engine.kv_groups import kv_groups
from engine.models import LoadedModel

PAGED_ATTENTION = "prefix_console_paged"


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence to compute in this step.

    The tokens sit at positions `start_pos .. start_pos + len(token_ids) - 1`; positions before
    `start_pos` must already hold K/V in the blocks. Per KV group, `groups[g]` lists the physical
    blocks from logical block `first_block` on, covering at least up to `start_pos + len(token_ids)`;
    keys before `first_block * block_size` are invisible to that group's layers, and positions before
    `write_from` are not written (they already hold K/V; their new K/V goes to a scratch block).
    """

    token_ids: list[int]  # non-empty
    start_pos: int  # position of token_ids[0]
    groups: tuple[GroupSlots, ...]  # one per KV group, in the runner's group order

    @classmethod
    def of_table(cls, token_ids: list[int], start_pos: int, block_table: list[int]) -> SeqChunk:
        """A chunk of a single-group model whose table starts at block 0 (the common case)."""
        return cls(token_ids, start_pos, (GroupSlots(block_table, 0, start_pos),))


class _Span(NamedTuple):
    """The positions one chunk computes and the blocks it reads, for layers with one window."""

    start: int  # first query position
    end: int  # one past the last query position
    first_visible: int  # earliest key position any of its queries sees
    first_block: int  # block-table index of the first block to gather
    end_block: int  # one past the last block-table index to gather
    base: int  # position of the first gathered key

    @classmethod
    def of(cls, start: int, num_queries: int, window: int | None, block_size: int, floor: int) -> _Span:
        """`floor`: the first position the group's table holds (block-aligned); nothing before is seen."""
        end = start + num_queries
        first_visible = max(floor, 0 if window is None else start - window + 1)
        first_block = first_visible // block_size
        end_block = -(-end // block_size)
        return cls(start, end, first_visible, first_block, end_block, first_block * block_size)


@dataclass(frozen=True)
class _Batch:
    """Chunks with one query length that share one SDPA call (queries padded to none, keys to the longest)."""

    rows: torch.Tensor  # [B * n] packed-sequence rows of the queries, chunk-major
    num_queries: int  # n: tokens per chunk
    block_ids: torch.Tensor | None  # [B * M] blocks to gather, chunk-major, padded with its first; None if causal
    num_keys: int  # keys kept per chunk after the gather (<= M * block_size)
    mask: torch.Tensor | None  # [B, 1, n, num_keys] bool (True = visible); None with is_causal or all visible
    is_causal: bool  # a lone chunk whose visible keys are exactly its own tokens


@dataclass(frozen=True)
class PagedContext:
    """Everything the attention function needs for one forward; passed as the `paged_context` kwarg."""

    kv: tuple[torch.Tensor, ...]  # per KV group: its block memory (last block: scratch)
    layers: tuple[tuple[int, int], ...]  # per model layer: (KV group, layer index within the group)
    windows: tuple[int | None, ...]  # per KV group: None (full) or the sliding window
    slots: tuple[torch.Tensor, ...]  # per KV group: [T] cache slot every packed token writes
    batches: tuple[tuple[_Batch, ...], ...]  # per KV group: the SDPA calls
    gather: tuple[torch.Tensor, torch.Tensor]  # flat K and V buffers the gathers of every layer reuse


class ModelRunner:
    """Owns the KV blocks of one model and runs packed forwards over them.

    Memory, per KV group g (see engine/kv_groups.py) with num_blocks[g] blocks plus one scratch block::

        kv[g][group layer, 0 = K | 1 = V, block, slot, kv_head, head_dim]

    Creating a runner switches `loaded.model` to paged attention: from then on the model only runs
    through this runner.
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int | Sequence[int], block_size: int) -> None:
        self.loaded = loaded
        self.groups = kv_groups(loaded.attention_spec)
        counts = [num_blocks] * len(self.groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(self.groups) or min(counts) < 1 or block_size < 1:
            raise ValueError(f"need one block count >= 1 per KV group and block_size >= 1, got {counts}, {block_size}")
        self.num_blocks = tuple(counts)
        self.block_size = block_size
        self.layers = tuple(
            next((g, spec.layers.index(layer)) for g, spec in enumerate(self.groups) if layer in spec.layers)
            for layer in range(loaded.num_layers)
        )
        self.kv = tuple(
            torch.zeros(
                (len(spec.layers), 2, count + 1, block_size, loaded.num_kv_heads, loaded.head_dim),
                dtype=loaded.dtype,
                device=loaded.device,
            )
            for spec, count in zip(self.groups, counts)
        )
        AttentionInterface.register(PAGED_ATTENTION, paged_attention)
        loaded.model.set_attn_implementation(PAGED_ATTENTION)
        if loaded.model.config._attn_implementation != PAGED_ATTENTION:
            raise ValueError(f"{type(loaded.model).__name__} does not accept a custom attention function")

    @staticmethod
    def bytes_per_block(loaded: LoadedModel, block_size: int, num_layers: int | None = None) -> int:
        """Device bytes one block takes across `num_layers` layers (default: all), K and V."""
        layers = loaded.num_layers if num_layers is None else num_layers
        return 2 * layers * block_size * loaded.num_kv_heads * loaded.head_dim * loaded.dtype.itemsize

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[Sequence[tuple[int, int, int]]]) -> None:
        """Copy the first `num_slots` slots of `src` into `dst` on every layer of a group, in order.

        Args:
            copies: per KV group, (src_block, dst_block, num_slots) triples.
        """
        for g, group_copies in enumerate(copies):
            for src, dst, num_slots in group_copies:
                self._check_blocks(g, [src, dst])
                if not 0 <= num_slots <= self.block_size:
                    raise ValueError(f"num_slots must be in [0, {self.block_size}], got {num_slots}")
                self.kv[g][:, :, dst, :num_slots] = self.kv[g][:, :, src, :num_slots]

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Compute every chunk's tokens in one forward, storing their K/V in their slots.

        Args:
            chunks: at least one chunk; see `SeqChunk` and the module invariants.

        Returns:
            float32 logits of each chunk's last token, shape [len(chunks), vocab_size].
        """
        if not chunks:
            raise ValueError("execute needs at least one chunk")
        device, size = self.loaded.device, self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in self.groups]
        last_rows: list[int] = []
        for chunk in chunks:
            self._check_chunk(chunk)
            end = chunk.start_pos + len(chunk.token_ids)
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, end))
            for g in range(len(self.groups)):
                slots[g].extend(self._slots(chunk, g))
            last_rows.append(len(token_ids) - 1)
        batches = tuple(self._plan_batches(chunks, g) for g in range(len(self.groups)))
        # One gather buffer per step, not one allocation per layer: a fresh multi-MB tensor is mapped and
        # page-faulted anew each time, which cost more than the copy itself (decodes of 64 requests: 2x).
        num_gathered = max((b.block_ids.numel() for bs in batches for b in bs if b.block_ids is not None), default=0)
        gather_numel = num_gathered * size * self.loaded.num_kv_heads * self.loaded.head_dim
        context = PagedContext(
            kv=self.kv,
            layers=self.layers,
            windows=tuple(spec.window for spec in self.groups),
            slots=tuple(torch.tensor(group_slots, device=device) for group_slots in slots),
            batches=batches,
            gather=tuple(torch.empty(gather_numel, dtype=self.loaded.dtype, device=device) for _ in range(2)),
        )
        output = self.loaded.model(
            input_ids=torch.tensor([token_ids], device=device),
            position_ids=torch.tensor([positions], device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(last_rows, device=device),
            paged_context=context,
        )
        return output.logits[0].float()

    @torch.inference_mode()
    def clear_slots(self, chunk: SeqChunk) -> None:
        """Zero the K/V a computed chunk wrote, in every layer (for a chunk whose forward went non-finite).

        Masked keys are still multiplied by their zero weight: a NaN left in a freed block's slots would
        turn into NaN for the next request that gathers that block, so it must not outlive its request.
        """
        for g, kv in enumerate(self.kv):
            slots = torch.tensor(self._slots(chunk, g), device=kv.device)
            kv.view(*kv.shape[:2], -1, *kv.shape[-2:]).index_fill_(2, slots, 0)

    def _slots(self, chunk: SeqChunk, g: int) -> list[int]:
        """The cache slot each of the chunk's positions writes in KV group g (the scratch block below
        `write_from`)."""
        size, table = self.block_size, chunk.groups[g]
        scratch = self.num_blocks[g] * size
        ids, first = table.block_ids, table.first_block
        return [
            scratch + p % size if p < table.write_from else ids[p // size - first] * size + p % size
            for p in range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))
        ]

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of a from-scratch forward with transformers' own SDPA attention.

        Reads and writes no block; used to measure approximate replays. Returns float32 [len, vocab].
        """
        model = self.loaded.model
        model.set_attn_implementation("sdpa")
        try:
            ids = torch.tensor([token_ids], device=self.loaded.device)
            return model(input_ids=ids, use_cache=False).logits[0].float()
        finally:
            model.set_attn_implementation(PAGED_ATTENTION)

    def _plan_batches(self, chunks: Sequence[SeqChunk], g: int) -> tuple[_Batch, ...]:
        """One SDPA call per prefill chunk and one for all decodes, for the layers of KV group g."""
        batches: list[_Batch] = []
        decodes: list[tuple[int, SeqChunk]] = []
        row = 0
        for chunk in chunks:
            if len(chunk.token_ids) == 1:
                decodes.append((row, chunk))
            else:
                batches.append(self._plan_batch([(row, chunk)], g))
            row += len(chunk.token_ids)
        if decodes:
            batches.append(self._plan_batch(decodes, g))
        return tuple(batches)

    def _plan_batch(self, members: list[tuple[int, SeqChunk]], g: int) -> _Batch:
        """Plan one SDPA call over chunks of equal length, for the layers of KV group g.

        Each chunk gathers the blocks from the one holding its first visible key (position 0, or
        `start_pos - window + 1`, never before its table's first block) to the one holding its last
        token; a lone chunk keeps exactly its keys, several are padded to the longest gather and masked.
        """
        size, device, window = self.block_size, self.loaded.device, self.groups[g].window
        num_queries = len(members[0][1].token_ids)
        spans = []
        block_ids: list[int] = []
        for _, chunk in members:
            table = chunk.groups[g]
            spans.append(_Span.of(chunk.start_pos, num_queries, window, size, table.first_block * size))
        num_gathered = max(span.end_block - span.first_block for span in spans)
        for (_, chunk), span in zip(members, spans):
            table = chunk.groups[g]
            blocks = table.block_ids[span.first_block - table.first_block : span.end_block - table.first_block]
            self._check_blocks(g, blocks)
            # Padding repeats the chunk's own first block: masked, yet multiplied by zero weights, so it must
            # be finite whatever another request of this step computed (a NaN there stays that request's).
            block_ids.extend(blocks + [blocks[0]] * (num_gathered - len(blocks)))
        rows = [row + i for row, _ in members for i in range(num_queries)]

        first = spans[0]
        lone = len(members) == 1
        num_keys = first.end - first.base if lone else num_gathered * size
        is_causal = lone and first.base == first.start and (window is None or num_queries <= window)
        sees_all = lone and num_queries == 1 and first.first_visible == first.base
        mask = None
        if not is_causal and not sees_all:
            starts = torch.tensor([span.start for span in spans]).view(-1, 1, 1)
            bases = torch.tensor([span.base for span in spans]).view(-1, 1, 1)
            query_pos = starts + torch.arange(num_queries).view(1, -1, 1)
            key_pos = bases + torch.arange(num_keys).view(1, 1, -1)
            visible = key_pos <= query_pos  # gathers start at or after the table's first block: no floor needed
            if window is not None:
                visible &= key_pos > query_pos - window
            mask = visible.unsqueeze(1).to(device)
        return _Batch(
            rows=torch.tensor(rows, device=device),
            num_queries=num_queries,
            block_ids=None if is_causal else torch.tensor(block_ids, device=device),
            num_keys=num_keys,
            mask=mask,
            is_causal=is_causal,
        )

    def _check_chunk(self, chunk: SeqChunk) -> None:
        end = chunk.start_pos + len(chunk.token_ids)
        if not chunk.token_ids or chunk.start_pos < 0:
            raise ValueError(f"a chunk needs tokens and start_pos >= 0, got {chunk}")
        if len(chunk.groups) != len(self.groups):
            raise ValueError(f"a chunk needs one table per KV group ({len(self.groups)}), got {len(chunk.groups)}")
        for table in chunk.groups:
            if (table.first_block + len(table.block_ids)) * self.block_size < end:
                raise ValueError(f"a block table ending at block {table.first_block + len(table.block_ids)} "
                                 f"cannot hold {end} positions")

    def _check_blocks(self, g: int, blocks: Sequence[int]) -> None:
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks[g]):
            raise ValueError(f"block ids must be in [0, {self.num_blocks[g]}), got {list(blocks)}")


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
    """Attention over paged K/V for one layer (the `AttentionInterface` signature).

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
    g, local = paged_context.layers[module.layer_idx]
    window = paged_context.windows[g]
    if kwargs.get("sliding_window", window) != window:
        raise RuntimeError(f"layer {module.layer_idx}: model window {kwargs['sliding_window']} != attention spec {window}")
    key_cache, value_cache = paged_context.kv[g][local]
    slots = paged_context.slots[g]
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[0].transpose(0, 1))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[0].transpose(0, 1))

    num_heads = query.shape[1]
    queries = query[0].transpose(0, 1)  # [T, num_heads, head_dim]
    output = torch.empty_like(queries)
    for batch in paged_context.batches[g]:
        n = batch.num_queries
        q = queries.index_select(0, batch.rows).view(-1, n, num_heads, head_dim).transpose(1, 2)
        if batch.is_causal:  # the visible keys are exactly the chunk's own: skip the gather
            k, v = key.index_select(2, batch.rows), value.index_select(2, batch.rows)
        else:
            k, v = (
                _gather_blocks(cache, batch.block_ids, buffer)
                .view(q.shape[0], -1, num_kv_heads, head_dim)[:, : batch.num_keys]
                .transpose(1, 2)
                for cache, buffer in zip((key_cache, value_cache), paged_context.gather)
            )
        attended = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=batch.mask,
            is_causal=batch.is_causal,
            scale=scaling,
            enable_gqa=num_heads != num_kv_heads,
        )
        output.index_copy_(0, batch.rows, attended.transpose(1, 2).reshape(-1, num_heads, head_dim))
    return output.unsqueeze(0), None


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`cache[block_ids]`, written into the front of `buffer` (overwritten by the next gather)."""
    out = buffer[: block_ids.numel() * cache[0].numel()].view(block_ids.numel(), *cache.shape[1:])
    return torch.index_select(cache, 0, block_ids, out=out)
