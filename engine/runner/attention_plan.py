"""Which keys each query of a step attends, grouped into kernel calls, with shared prefixes read once.

Built once per step and KV group, on the host, from the block tables the runner receives (no request
ids, no hashes). For chunk i with queries at positions [s_i, e_i) and a table from logical block f_i::

    query at p sees the keys at [max(f_i * bs, p - W + 1), p]          (W: window; none for full attention)

Cascade (shared-prefix) attention. A run of logical blocks [a, b) is *shareable* by a chunk when every
query of the chunk sees all of it: it ends before the first query (b * bs <= s_i) and, with a window,
starts within the window of the last one (a * bs >= e_i - W). Chunks whose shareable runs start at the
same logical block a on the same physical block form a sharing group (forks of one parent; prefix hits
on one chain); their shared run is the longest [a, b) on which every member's table holds the same
physical blocks. When `CascadeRule.pays`, the group reads that run once::

    shared call    the queries of every member, as one batch element, over the keys of [a, b), no mask
    private call   each member over its other visible keys: [first visible, a) and [b, its last query]

and each query's two partial results are merged exactly by their log-sum-exps (engine/runner/attention_kernels.py).
A group has one shared run: when some members share deeper than all of them, the extra depth is private.

Calls (every query row is in exactly one non-shared call, and in at most one shared call after it):
  * decodes (one query) form one batch: read in place by the paged decode kernel when the runner has it
    (`KeySource.PAGED`: each element's block list and mask fields, nothing gathered), else gathered,
    keys padded to the longest and masked;
  * prefill chunks whose keys are exactly their own tokens (block-aligned start, nothing earlier visible,
    all written now, no window shorter than the chunk) read those keys from the fresh K/V tensors with
    a causal kernel, one batch per query length, no gather and no mask;
  * any other prefill chunk is a call of its own over exactly its gathered keys, masked unless every
    query sees every key.

Keys of a call with one batch element whose blocks are consecutive physical blocks (a prefix cached in a
fresh pool, a lone request's table) are read as a view of the block memory, not gathered. Measured on
SmolLM2 (8 decodes sharing a 1,024-token prefix, 30 layers, 2 cores): gathering the run cost 5.8 ms a
step next to the kernel's 12 ms over it, all of which a view saves. Consecutive rows are sliced, not
indexed.

Every integer the device needs (token ids, slots, rows, block ids, mask inputs) goes into one `IndexPack`
and reaches the device in one transfer; masks are then built there, once per step for all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from engine.core.arith import ceil_div, common_prefix


@dataclass(frozen=True, slots=True)
class GroupSlots:
    """The runner's input, per KV group and chunk (`SeqChunk.groups`): one KV group's view of a chunk: where its tokens' K/V live and which positions it writes."""

    block_ids: list[int]  # physical blocks of logical blocks first_block, first_block + 1, ...
    first_block: int  # logical index of block_ids[0]; keys before first_block * block_size are not visible
    write_from: int  # positions below this already hold K/V in this group: the chunk does not write them


@dataclass(frozen=True)
class CascadeRule:
    """When reading a shared run once for its sharers pays.

    Per layer, the plain path copies the run's blocks once per sharer (each sharer gathers all its keys).
    Cascade copies them once, or not at all when the run's physical blocks are consecutive (read in
    place), so it saves (sharers - 1) x blocks or sharers x blocks block copies, and the kernel's
    redundant passes over them; it costs one more kernel call and a merge. (Decodes read by the paged
    decode kernel copy nothing on the plain path: for them a run read in place saves the redundant
    passes only, (sharers - 1) x blocks.) It pays once the saved copies
    reach a fixed number, measured by `benchmarks/cascade_attention.py` (see `CPU_CASCADE`).
    """

    enabled: bool  # False: the plain path, every chunk reads all its keys itself
    min_saved_blocks: int  # block copies a layer must save, at least (0: every shareable run)

    def pays(self, num_sharers: int, num_blocks: int, in_place: bool) -> bool:
        saved = (num_sharers - (0 if in_place else 1)) * num_blocks
        return self.enabled and num_blocks > 0 and saved >= self.min_saved_blocks


NO_CASCADE = CascadeRule(enabled=False, min_saved_blocks=0)
ALWAYS_CASCADE = CascadeRule(enabled=True, min_saved_blocks=0)  # every shareable run, even a lone chunk's
# Measured with benchmarks/cascade_attention.py (SmolLM2's attention, fp32, 2 threads, block size 16, K/V out
# of the caches, head-major blocks, 96 cells of 1-64 sharers over 1-64 blocks): fitted on process CPU time,
# cascade pays from 32 saved copies per layer; the 12 cells on the wrong side differ by under 0.2 ms per layer
# either way. (With token-major blocks, whose gathers cost 3x more, it paid from 24.) 8 decodes over a
# 1,024-token prefix save 448-512.
CPU_CASCADE = CascadeRule(enabled=True, min_saved_blocks=32)
# Not measured on a GPU yet (benchmarks/cuda_check.py reports cascade on and off side by side). Splitting
# even a lone chunk's cached prefix off lets both halves run on FlashAttention instead of a masked kernel.
CUDA_CASCADE = ALWAYS_CASCADE


class IndexPack:
    """Host integer lists gathered into one int64 tensor, moved to the device in one transfer."""

    def __init__(self) -> None:
        self._values: list[int] = []

    def add(self, values: Sequence[int]) -> slice:
        """Append `values`; returns where they will sit in the packed tensor."""
        start = len(self._values)
        self._values.extend(values)
        return slice(start, len(self._values))

    def to(self, device: torch.device) -> torch.Tensor:
        packed = torch.tensor(self._values, dtype=torch.int64)
        if device.type == "cuda":  # pinned, so the copy is asynchronous and the host never waits on the device
            return packed.pin_memory().to(device, non_blocking=True)
        return packed.to(device)


class ChunkQueries(NamedTuple):
    """One chunk as the planner sees it, for one KV group."""

    row: int  # packed-sequence row of its first token
    start: int  # position of its first token
    num_queries: int  # its tokens
    table: GroupSlots  # its blocks in this group


class KeySource(Enum):
    """Where a call's keys come from."""

    OWN = "own"  # the fresh K/V of the call's own tokens (causal, nothing read from the blocks)
    VIEW = "view"  # one element over consecutive physical blocks: a view of the block memory
    GATHER = "gather"  # blocks gathered into the step's buffer (element-major, padded)
    PAGED = "paged"  # decodes: each element's blocks read in place by the paged decode kernel


@dataclass(frozen=True)
class HostCall:
    """One kernel call of every layer of a group, with its integers in the step's `IndexPack`."""

    rows: range | slice  # query rows, element-major: a range when consecutive, else their place in the pack
    num_queries: int  # n: queries per batch element
    keys: KeySource
    blocks: range | slice | None  # VIEW: the physical blocks; GATHER, PAGED: their place in the pack; OWN: None
    num_keys: int  # keys kept per element (the own rows' count for OWN)
    causal: bool  # keys are the element's own tokens: query i sees keys 0..i
    mask: slice | None  # per element [first query position, valid key slots, logical block of each listed block]
    merges: bool  # a shared call: its partial results merge into the rows' earlier ones

    @property
    def num_gathered(self) -> int:
        """Blocks this call gathers into the step's buffer."""
        return self.blocks.stop - self.blocks.start if self.keys is KeySource.GATHER else 0

    def realize(self, packed: torch.Tensor, block_size: int, window: int | None, dtype: torch.dtype) -> AttentionCall:
        """The call on the device: views into the packed tensor and, if masked, its additive bias."""
        rows = slice(self.rows.start, self.rows.stop) if isinstance(self.rows, range) else packed[self.rows]
        num_rows = self.rows.stop - self.rows.start
        if self.keys is KeySource.PAGED:
            blocks_per_element = self.num_keys // block_size
            blocks = packed[self.blocks].view(num_rows, blocks_per_element)
            fields = packed[self.mask].view(num_rows, 2 + blocks_per_element)
            return AttentionCall(rows, num_rows, 1, self.keys, blocks, self.num_keys, False, None, False, fields)
        bias = None
        if self.mask is not None:
            blocks_per_element = ceil_div(self.num_keys, block_size)
            fields = packed[self.mask].view(num_rows // self.num_queries, 2 + blocks_per_element)
            bias = mask_bias(fields, self.num_queries, self.num_keys, block_size, window, dtype)
        blocks = self.blocks
        if self.keys is KeySource.GATHER:
            blocks = packed[self.blocks]
        elif self.keys is KeySource.VIEW:
            blocks = slice(self.blocks.start, self.blocks.stop)
        return AttentionCall(rows, num_rows, self.num_queries, self.keys, blocks, self.num_keys, self.causal, bias, self.merges)


@dataclass(frozen=True)
class AttentionCall:
    """One kernel call of every layer of a group, on the device (see `HostCall`)."""

    rows: slice | torch.Tensor  # [B * n] query rows: a slice when consecutive
    num_rows: int  # B * n
    num_queries: int  # n
    keys: KeySource
    blocks: slice | torch.Tensor | None  # VIEW: physical blocks as a slice; GATHER: [B * M] block ids; PAGED: [B, M]
    num_keys: int  # keys per element
    causal: bool  # own tokens, query i sees keys 0..i
    bias: torch.Tensor | None  # [B, 1, n, num_keys] additive (0 visible, -inf hidden), in the model's dtype
    merges: bool  # merge into the rows' earlier partial results
    fields: torch.Tensor | None = None  # PAGED: [B, 2 + M] query position, valid slots, logical blocks


def plan_group(
    chunks: Sequence[ChunkQueries],
    window: int | None,
    block_size: int,
    rule: CascadeRule,
    pack: IndexPack,
    *,
    decodes_in_place: bool = False,
) -> tuple[HostCall, ...]:
    """The calls of one KV group for one step: non-shared calls first, then the shared ones that merge.
    With `decodes_in_place` the decodes are one PAGED call (the runner has the paged decode kernel)."""
    bs = block_size
    shared_runs = _sharing_groups(chunks, window, bs, rule, decodes_in_place)
    run_of = {member: (first, end) for members, first, end in shared_runs for member in members}
    own: dict[int, list[int]] = {}  # query length -> chunks whose keys are their own fresh tokens
    decodes: list[_Keys] = []
    calls: list[HostCall] = []
    for i, chunk in enumerate(chunks):
        end = chunk.start + chunk.num_queries
        first_visible = max(chunk.table.first_block * bs, 0 if window is None else chunk.start - window + 1)
        ranges = [(first_visible // bs, ceil_div(end, bs))]
        if i in run_of:
            first, run_end = run_of[i]
            ranges = [(ranges[0][0], first), (run_end, ranges[0][1])]
        keys = _Keys.of(chunk, [r for r in ranges if r[0] < r[1]], bs)
        if chunk.num_queries == 1:
            decodes.append(keys)
        elif keys.are_own_tokens(chunk, window, bs):
            own.setdefault(chunk.num_queries, []).append(i)
        else:
            calls.append(_gathered_call([keys], chunk.num_queries, window, bs, pack))
    for num_queries, members in own.items():
        rows = [chunks[i].row + q for i in members for q in range(num_queries)]
        calls.append(HostCall(_rows(rows, pack), num_queries, KeySource.OWN, None, num_queries, True, None, False))
    if decodes:
        calls.append(_paged_call(decodes, bs, pack) if decodes_in_place else _gathered_call(decodes, 1, window, bs, pack))
    for members, first, end in shared_runs:
        rows = [chunks[i].row + q for i in members for q in range(chunks[i].num_queries)]
        keys, blocks = _blocks(_blocks_from(chunks[members[0]].table, first, end - first), pack)
        calls.append(HostCall(_rows(rows, pack), len(rows), keys, blocks, (end - first) * bs, False, None, True))
    return tuple(calls)


def _consecutive(values: list[int]) -> bool:
    return bool(values) and values == list(range(values[0], values[0] + len(values)))


def _rows(rows: list[int], pack: IndexPack) -> range | slice:
    """Consecutive rows as a range (sliced on the device), others through the pack (indexed)."""
    return range(rows[0], rows[0] + len(rows)) if _consecutive(rows) else pack.add(rows)


def _blocks(block_ids: list[int], pack: IndexPack) -> tuple[KeySource, range | slice]:
    """One element's blocks: a view when they are consecutive physical blocks, else gathered."""
    if _consecutive(block_ids):
        return KeySource.VIEW, range(block_ids[0], block_ids[0] + len(block_ids))
    return KeySource.GATHER, pack.add(block_ids)


class _Keys(NamedTuple):
    """The keys one chunk reads in a non-shared call: whole logical blocks, in increasing order."""

    row: int  # first query row
    start: int  # first query position
    logical: list[int]  # logical blocks
    physical: list[int]  # their physical blocks
    num_valid: int  # slots kept: all of the blocks' but those at or after the chunk's end

    @classmethod
    def of(cls, chunk: ChunkQueries, ranges: list[tuple[int, int]], bs: int) -> _Keys:
        table = chunk.table
        logical = [j for first, end in ranges for j in range(first, end)]
        physical = [table.block_ids[j - table.first_block] for j in logical]
        past_end = ranges[-1][1] * bs - (chunk.start + chunk.num_queries)  # slots of the last block after the chunk
        return cls(chunk.row, chunk.start, logical, physical, len(logical) * bs - past_end)

    def are_own_tokens(self, chunk: ChunkQueries, window: int | None, bs: int) -> bool:
        """Exactly the chunk's own tokens, all written in this step, causal within any window."""
        return (
            self.logical[0] * bs == chunk.start
            and chunk.table.write_from <= chunk.start
            and (window is None or chunk.num_queries <= window)
        )

    def all_visible(self, num_queries: int, window: int | None, bs: int) -> bool:
        """Every kept key is visible to every query (the kept keys end at the chunk's last token)."""
        end = self.start + num_queries
        return num_queries == 1 and (window is None or self.logical[0] * bs >= end - window)


def _gathered_call(
    elements: list[_Keys], num_queries: int, window: int | None, bs: int, pack: IndexPack
) -> HostCall:
    """One call over gathered blocks: a lone element keeps exactly its keys; several are padded and masked."""
    blocks_per_element = max(len(e.logical) for e in elements)
    lone = len(elements) == 1
    num_keys = elements[0].num_valid if lone else blocks_per_element * bs
    rows = [e.row + q for e in elements for q in range(num_queries)]
    if lone:
        keys, blocks = _blocks(elements[0].physical, pack)
    else:
        # Padding repeats each element's own first block: masked, yet multiplied by zero weights, so it must be
        # finite whatever another request of this step computed (a NaN there stays that request's).
        padded = [b for e in elements for b in e.physical + [e.physical[0]] * (blocks_per_element - len(e.physical))]
        keys, blocks = KeySource.GATHER, pack.add(padded)
    mask = None
    if not (lone and elements[0].all_visible(num_queries, window, bs)):
        fields = []
        for e in elements:  # per element: first query position, valid slots, logical blocks (padding: masked)
            fields += [e.start, e.num_valid, *e.logical, *[e.logical[0]] * (blocks_per_element - len(e.logical))]
        mask = pack.add(fields)
    return HostCall(_rows(rows, pack), num_queries, keys, blocks, num_keys, False, mask, False)


def _paged_call(elements: list[_Keys], bs: int, pack: IndexPack) -> HostCall:
    """Decodes read in place: per element its physical blocks and mask fields, padded with its first block
    (never read: the kernel stops at the valid slots)."""
    blocks_per_element = max(len(e.logical) for e in elements)
    physical, fields = [], []
    for e in elements:
        padding = blocks_per_element - len(e.logical)
        physical += e.physical + [e.physical[0]] * padding
        fields += [e.start, e.num_valid, *e.logical, *[e.logical[0]] * padding]
    rows = _rows([e.row for e in elements], pack)
    return HostCall(rows, 1, KeySource.PAGED, pack.add(physical), blocks_per_element * bs, False, pack.add(fields), False)


def mask_bias(
    fields: torch.Tensor, num_queries: int, num_keys: int, bs: int, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """[B, 1, n, num_keys] additive mask from per-element [first query position, valid slots, logical blocks]
    (the fields a PAGED call hands the paged decode kernel, which applies the same rule)."""
    device = fields.device
    query_pos = fields[:, :1] + torch.arange(num_queries, device=device)  # [B, n]
    key_pos = (fields[:, 2:, None] * bs + torch.arange(bs, device=device)).flatten(1)[:, :num_keys]  # [B, L]
    slot = torch.arange(num_keys, device=device)
    visible = (slot < fields[:, 1:2]).unsqueeze(1) & (key_pos.unsqueeze(1) <= query_pos.unsqueeze(2))
    if window is not None:
        visible &= key_pos.unsqueeze(1) > query_pos.unsqueeze(2) - window
    bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return bias.unsqueeze(1)


def _sharing_groups(
    chunks: Sequence[ChunkQueries], window: int | None, bs: int, rule: CascadeRule, decodes_in_place: bool
) -> list[tuple[list[int], int, int]]:
    """(members, first logical block, end logical block) of every shared run the rule says pays.

    A run read in place (consecutive blocks) saves even a lone member's copy of it, unless that member
    would read it in place anyway: decodes with the paged decode kernel gather nothing. A lone decode
    then reads all its keys in one call (1 decode over 1,056 keys, SmolLM2: 114 us a layer instead of
    253 us for the split, fp32)."""
    if not rule.enabled:
        return []
    by_anchor: dict[tuple[int, int], list[int]] = {}
    shareable: list[tuple[int, int]] = []
    for i, chunk in enumerate(chunks):
        end = chunk.start + chunk.num_queries
        first = chunk.table.first_block if window is None else max(chunk.table.first_block, ceil_div(end - window, bs))
        shareable.append((first, chunk.start // bs))
        if first < chunk.start // bs:
            by_anchor.setdefault((first, chunk.table.block_ids[first - chunk.table.first_block]), []).append(i)
    runs = []
    for (first, _), members in by_anchor.items():
        depth = min(shareable[i][1] for i in members) - first
        reference = _blocks_from(chunks[members[0]].table, first, depth)
        for i in members[1:]:
            depth = common_prefix(reference[:depth], _blocks_from(chunks[i].table, first, depth))
        plain_reads_in_place = decodes_in_place and all(chunks[i].num_queries == 1 for i in members)
        if rule.pays(len(members), depth, _consecutive(reference[:depth]) and not plain_reads_in_place):
            runs.append((members, first, first + depth))
    return runs


def _blocks_from(table: GroupSlots, first: int, count: int) -> list[int]:
    offset = first - table.first_block
    return table.block_ids[offset : offset + count]
