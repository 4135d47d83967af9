"""The torch side of the engine: the KV block memory and one packed forward per step.

The runner knows block ids and positions, never requests, hashes or tokenization. Memory is allocated
once::

    kv[layer, 0 = K | 1 = V, kv_head, block, slot, head_dim]

    position p of a sequence -> block_table[p // block_size], slot p % block_size

Head-major, as the kernels read it: a run of consecutive blocks is one view with each head's keys in
consecutive rows, a gather copies whole blocks of one head (block_size * head_dim values), and the
model's new K/V ([kv_head, tokens, head_dim]) is written without a transpose. Measured against the
token-major layout (block, slot, kv_head) on SmolLM2, 8 decodes over a shared 1,024-token prefix: the
step's gathers took 1.2 ms instead of 3.9.

`execute` packs the tokens of every chunk into one sequence (per-token positions) and runs one forward
over it with paged attention (`attend_paged`, engine/runner/paged_attention.py): a Llama-family model
(Llama, Mistral, Qwen2, Qwen3) through engine/runner/decoder_forward.py, written out over its weights;
any other model through transformers' modules, with `attend_paged` registered as an attention function
(`AttentionInterface`) and the per-step plan passed through the forward's keyword arguments. Layers are
split into KV groups (full and sliding, engine/core/kv_groups.py), each with its own block memory and
tables, and one plan (engine/runner/attention_plan.py). In each layer the function first writes the new
K/V of all tokens into their slots, then runs the plan's kernel calls: decodes in one call (each reading
its blocks in place with the paged decode kernel on the CPU, else one padded batch), prefill chunks whose
keys are their own tokens causally without a gather, other chunks over their gathered blocks, and, when
several chunks share leading blocks, the shared run once for all of them, merged by log-sum-exp (cascade
attention). Only the last token of each chunk reaches the LM head, so the decoder's last layer runs a
second plan: every token's K/V written, then those last tokens' queries alone, as decodes.

Nothing in a step waits on the device: every index the step needs is built on the host and moved in one
transfer, masks are built on the device, and the kernels are chosen once per runner
(engine/runner/attention_kernels.py).

Invariants the caller keeps: no two chunks in one call write the same slot, and no chunk reads a slot
another chunk of the same call writes (copy-on-write happens before, through `copy_blocks`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from engine.runner.attention_kernels import choose_kernels
from engine.runner.attention_plan import (
    CPU_CASCADE,
    CUDA_CASCADE,
    AttentionCall,
    CascadeRule,
    ChunkQueries,
    GroupSlots,
    HostCall,
    IndexPack,
    plan_group,
)
from engine.core.kv_groups import kv_groups
from engine.core.kv_memory import kv_bytes_per_block
from engine.runner.decoder_forward import DecoderForward, unsupported_reason
from engine.runner.host_memory import keep_freed_memory
from engine.runner.model_loading import LoadedModel
from engine.runner.packed_linear import linear_kernels, pack_linears
from engine.runner.paged_attention import PAGED_ATTENTION, PagedContext, attend_paged, paged_attention


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


class ModelRunner:
    """Owns the KV blocks of one model and runs packed forwards over them.

    Memory, per KV group g (see engine/core/kv_groups.py) with num_blocks[g] blocks plus one scratch block::

        kv[g][group layer, 0 = K | 1 = V, kv_head, block, slot, head_dim]

    A Llama-family model runs through `DecoderForward` (unless `decoder_forward=False`) and `loaded.model`
    is left as it was. Any other model is switched to paged attention and, on the CPU, its decoder layers'
    linears to oneDNN-packed weights (engine/runner/packed_linear.py): from then on it only runs through
    this runner. `forward_path` says which. `cascade` says when chunks sharing leading blocks read them
    once (default: the rule measured for the device, `CPU_CASCADE` or `CUDA_CASCADE`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int | Sequence[int],
        block_size: int,
        *,
        cascade: CascadeRule | None = None,
        decoder_forward: bool = True,
    ) -> None:
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
                (len(spec.layers), 2, loaded.num_kv_heads, count + 1, block_size, loaded.head_dim),
                dtype=loaded.dtype,
                device=loaded.device,
            )
            for spec, count in zip(self.groups, counts)
        )
        self.num_heads = int(loaded.model.config.num_attention_heads)
        self.cascade = cascade if cascade is not None else CPU_CASCADE if loaded.device.type == "cpu" else CUDA_CASCADE
        self.kernels = choose_kernels(loaded.device, loaded.dtype, self.num_heads, loaded.num_kv_heads, loaded.head_dim)
        why_not = unsupported_reason(loaded.model) if decoder_forward else "decoder_forward=False"
        self.decoder = DecoderForward(loaded.model, loaded.device, loaded.dtype) if why_not is None else None
        self.forward_path = (
            f"decoder, {self.decoder.steps.name}, linears: {linear_kernels(loaded.device, loaded.dtype)}"
            if self.decoder is not None
            else f"transformers ({why_not})"
        )
        self.num_packed_linears = 0
        if loaded.device.type == "cpu":
            keep_freed_memory()  # the forward's temporaries live in host memory (engine/runner/host_memory.py)
        if self.decoder is None:
            self.num_packed_linears = pack_linears(loaded.model, loaded.device, loaded.dtype)
            AttentionInterface.register(PAGED_ATTENTION, paged_attention)
            loaded.model.set_attn_implementation(PAGED_ATTENTION)
            if loaded.model.config._attn_implementation != PAGED_ATTENTION:
                raise ValueError(f"{type(loaded.model).__name__} does not accept a custom attention function")

    @staticmethod
    def bytes_per_block(loaded: LoadedModel, block_size: int, num_layers: int | None = None) -> int:
        """Device bytes one block takes across `num_layers` layers (default: all), K and V."""
        layers = loaded.num_layers if num_layers is None else num_layers
        dtype = str(loaded.dtype).removeprefix("torch.")
        return kv_bytes_per_block(layers, loaded.num_kv_heads, loaded.head_dim, dtype, block_size)

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
                self.kv[g][:, :, :, dst, :num_slots] = self.kv[g][:, :, :, src, :num_slots]

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
        queries: list[list[ChunkQueries]] = [[] for _ in self.groups]
        last_rows: list[int] = []
        for chunk in chunks:
            self._check_chunk(chunk)
            end = chunk.start_pos + len(chunk.token_ids)
            for g, table in enumerate(chunk.groups):
                slots[g].extend(self._slots(chunk, g))
                queries[g].append(ChunkQueries(len(token_ids), chunk.start_pos, len(chunk.token_ids), table))
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, end))
            last_rows.append(len(token_ids) - 1)
        pack = IndexPack()
        inputs = pack.add(token_ids), pack.add(positions), pack.add(last_rows)
        slot_fields = [pack.add(group_slots) for group_slots in slots]
        in_place = self.kernels.decodes is not None
        plans = [
            plan_group(queries[g], spec.window, size, self.cascade, pack, decodes_in_place=in_place)
            for g, spec in enumerate(self.groups)
        ]
        # the decoder's last layer: past its attention only the last tokens reach the LM head
        last_token_plans = None
        if self.decoder is not None and len(token_ids) > len(chunks):
            last_token_plans = [
                plan_group([_last_token(q) for q in queries[g]], spec.window, size, self.cascade, pack, decodes_in_place=in_place)
                for g, spec in enumerate(self.groups)
            ]
        packed = pack.to(device)  # the step's one host-to-device transfer
        calls = self._realize(plans, packed)
        last_token_calls = None if last_token_plans is None else self._realize(last_token_plans, packed)
        # One gather buffer per step, not one allocation per layer: a fresh multi-MB tensor is mapped and
        # page-faulted anew each time, which cost more than the copy itself (decodes of 64 requests: 2x).
        every_plan = plans + (last_token_plans or [])
        num_gathered = max((call.num_gathered for plan in every_plan for call in plan), default=0)
        gather_numel = num_gathered * size * self.loaded.num_kv_heads * self.loaded.head_dim
        context = PagedContext(
            kv=self.kv,
            layers=self.layers,
            windows=tuple(spec.window for spec in self.groups),
            slots=tuple(packed[field] for field in slot_fields),
            calls=calls,
            last_token_calls=last_token_calls,
            kernels=self.kernels,
            gather=tuple(torch.empty(gather_numel, dtype=self.loaded.dtype, device=device) for _ in range(2)),
            lse=torch.empty(len(token_ids), self.num_heads, dtype=torch.float32, device=device),
        )
        token_field, position_field, rows_field = (packed[field] for field in inputs)
        if self.decoder is not None:
            attention = functools.partial(attend_paged, context)
            return self.decoder(token_field, position_field, rows_field, attention).float()
        output = self.loaded.model(
            input_ids=token_field.view(1, -1),
            position_ids=position_field.view(1, -1),
            use_cache=False,
            logits_to_keep=rows_field,
            paged_context=context,
        )
        return output.logits[0].float()

    def _realize(self, plans: Sequence[tuple[HostCall, ...]], packed: torch.Tensor) -> tuple[tuple[AttentionCall, ...], ...]:
        """Every KV group's planned calls on the device."""
        return tuple(
            tuple(call.realize(packed, self.block_size, spec.window, self.loaded.dtype) for call in plan)
            for spec, plan in zip(self.groups, plans)
        )

    @torch.inference_mode()
    def clear_slots(self, chunk: SeqChunk) -> None:
        """Zero the K/V a computed chunk wrote, in every layer (for a chunk whose forward went non-finite).

        Masked keys are still multiplied by their zero weight: a NaN left in a freed block's slots would
        turn into NaN for the next request that gathers that block, so it must not outlive its request.
        """
        for g, kv in enumerate(self.kv):
            slots = torch.tensor(self._slots(chunk, g), device=kv.device)
            kv.view(*kv.shape[:3], -1, kv.shape[-1]).index_fill_(3, slots, 0)

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
        implementation = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            ids = torch.tensor([token_ids], device=self.loaded.device)
            return model(input_ids=ids, use_cache=False).logits[0].float()
        finally:
            model.set_attn_implementation(implementation)

    def _check_chunk(self, chunk: SeqChunk) -> None:
        end = chunk.start_pos + len(chunk.token_ids)
        if not chunk.token_ids or chunk.start_pos < 0:
            raise ValueError(f"a chunk needs tokens and start_pos >= 0, got {chunk}")
        if len(chunk.groups) != len(self.groups):
            raise ValueError(f"a chunk needs one table per KV group ({len(self.groups)}), got {len(chunk.groups)}")
        for g, table in enumerate(chunk.groups):
            if (table.first_block + len(table.block_ids)) * self.block_size < end:
                raise ValueError(f"a block table ending at block {table.first_block + len(table.block_ids)} "
                                 f"cannot hold {end} positions")
            self._check_blocks(g, table.block_ids)

    def _check_blocks(self, g: int, blocks: Sequence[int]) -> None:
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks[g]):
            raise ValueError(f"block ids must be in [0, {self.num_blocks[g]}), got {list(blocks)}")


def _last_token(chunk: ChunkQueries) -> ChunkQueries:
    """The chunk's last token alone."""
    last = chunk.num_queries - 1
    return chunk._replace(row=chunk.row + last, start=chunk.start + last, num_queries=1)
