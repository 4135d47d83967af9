"""The engine's prefix-cache changes as vLLM 0.33's KV events: the wire types and the translation.

vLLM, SGLang, llm-d's KV-cache indexer and NVIDIA Dynamo's KV router speak one feed (see
engine/feeds/kv_event_publisher.py for the sockets). This module makes its messages from the engine's own
`Event`s, so the feed is a pure function of what the engine's listeners (and the history) receive, after
an opening batch for a restarted engine's warm disk tier (below):

    CACHE  (blocks entered the prefix index)   -> BlockStored per run of chained blocks, the pool's medium
    EVICT  (a cached block lost its key)       -> BlockRemoved, one per block (as vLLM sends them)
    RESET  of every KV group, none keeping a referenced block, and no disk tier
                                               -> AllBlocksCleared after the groups' BlockRemoved
    DEMOTE (the disk tier took an evicted block) -> BlockStored, medium "DISK", one block
    TIER_EVICT (the disk tier gave a block up), TIER_DROP of a demoted block (its write failed)
                                               -> BlockRemoved, medium "DISK"
    TIER_DROP of a block never demoted (the tier was full), PROMOTE -> nothing

Two media, as the engine's two tiers hold blocks: the pool's ("CPU", or "GPU" on CUDA) and the disk
tier's ("DISK"; vLLM 0.33 names its own file tier "STORAGE"). A consumer that applies BlockStored and
BlockRemoved per medium holds exactly the pool's cached blocks under the one and the tier's blocks
under the other: a demoted block stays under "DISK" until the tier gives it up, and a promoted one is
read into fresh pool blocks that the pool caches again (their CACHE: a new BlockStored under the
pool's medium), so it is then held in both. A DEMOTE is published when the tier plans the store
(the tier's `writing` state, found by no lookup until the writer confirms it); a failed write is its
TIER_DROP, published as the removal. A reset empties the pool only: its per-block BlockRemoved say so,
and an engine with a disk tier never sends AllBlocksCleared (the event names no medium, and consumers
drop every medium on it). Blocks a restarted engine finds in its tier's files have no event: the feed
opens with them (`announce_disk`, from `disk_blocks`), a BlockStored "DISK" each, followed from then on
like demoted ones. A restored entry does not say whether its parent key is a namespace root, so each
names its parent's hash (a context's first block: its root's, which no block has): the counts are
exact, but a consumer walking from a prompt's start reaches a warm tier's blocks only from a block held
elsewhere (the pool's, once the first request promoted and cached the chain's start).

Field by field, as vLLM's BlockPool fills them:
    block_hashes       the low 64 bits of the engine's 128-bit chain key, an unsigned int
                       (vLLM's `maybe_convert_block_hash`: int.from_bytes(key, "big") & (2**64 - 1));
                       a block has the same hash in both media
    parent_block_hash  the same of the block's chain parent; None under the namespace root
    token_ids          the blocks' tokens back to back (always block_size per block: only full blocks
                       are cached); block_size the engine's
    medium             the pool's: "GPU" when the KV lives on a CUDA device, else "CPU"; "DISK" for the
                       disk tier
    group_idx          the KV group's position in the model's groups (full attention first; the disk
                       tier holds full-attention blocks only)
    kv_cache_spec_kind "full_attention" or "sliding_window", kv_cache_spec_sliding_window its window
                       (vLLM annotates every BlockStored with both)
    lora_id, lora_name None (no adapters); extra_keys None (the tenant salt is folded into the root)

A CACHE event's blocks are usually one chain; when a block was skipped (an identical twin is cached) the
next one hangs from the twin, so the event splits where a block's parent is not the block before it.

The wire types mirror vLLM 0.33's `vllm.distributed.kv_events` field for field (names, order, defaults,
`omit_defaults`, tags, the array-encoded batch), so msgspec encodes them to the same bytes; the engine
imports nothing from vLLM or from fleet/ (tests/test_kv_event_publisher.py compares with both).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from engine.core.events import Event, EventKind
from engine.core.kv_tier import TierIndex

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"  # the engine's disk tier (engine/core/kv_tier.py)
FULL_ATTENTION_KIND = "full_attention"  # vLLM's KVCacheSpecKind values
SLIDING_WINDOW_KIND = "sliding_window"
_LOW_64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: the events of one engine step (vLLM's EventBatch / KVEventBatch)."""

    ts: float  # wall clock when the batch was made (seconds since the epoch)
    events: list[Any]  # BlockStored | BlockRemoved | AllBlocksCleared
    data_parallel_rank: int | None = None  # the engine's data-parallel rank (0: this engine is alone)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A map tagged {"type": <class name>} on the wire."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache, chained after `parent_block_hash`."""

    block_hashes: list[int]  # one per block, in chain order (low 64 bits of each chain key)
    parent_block_hash: int | None  # the block before the first; None under the namespace root
    token_ids: list[int]  # the blocks' tokens back to back
    block_size: int  # tokens per block
    lora_id: int | None  # deprecated by vLLM; None
    medium: str | None  # "GPU" or "CPU" (the pool), "DISK" (the disk tier)
    lora_name: str | None  # None (no adapters)
    extra_keys: list[tuple[Any, ...] | None] | None = None  # None (the salt is part of the root key)
    group_idx: int | None = None  # the KV group
    kv_cache_spec_kind: str | None = None  # "full_attention" | "sliding_window"
    kv_cache_spec_sliding_window: int | None = None  # the window of a sliding group
    locality: str | None = None  # not said
    ownership: str | None = None  # not said
    session_id: str | None = None  # not said
    lookahead_token_ids: list[list[int]] | None = None  # no lookahead hashing


class BlockRemoved(KVCacheEvent):
    """Cached blocks left the prefix cache (the engine sends one per evicted block)."""

    block_hashes: list[int]  # as in BlockStored
    medium: str | None  # as in BlockStored
    group_idx: int | None = None  # as in BlockStored
    locality: str | None = None  # not said
    ownership: str | None = None  # not said


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache is empty after a reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def external_hash(key_hex: str) -> int:
    """The published hash of a chain key (hex): its low 64 bits, unsigned."""
    return int(key_hex, 16) & _LOW_64


class DiskBlock(NamedTuple):
    """A block the disk tier holds, as the feed announces it."""

    key: str  # its chain key (hex)
    parent_key: str | None  # its parent's key (hex); None under a namespace root
    token_ids: list[int]  # its tokens


def disk_blocks(tier: TierIndex) -> list[DiskBlock]:
    """The blocks `tier` holds and serves, least recently used first (a restarted engine's warm tier), each
    under its parent's key (a namespace root's for a first block: an entry does not say which it is).
    Read while no step runs (before the engine starts)."""
    return [DiskBlock(e.key.hex(), e.parent_key.hex(), list(e.token_ids)) for e in tier.entries(tier.num_slots)[::-1]]


@dataclass(frozen=True)
class GroupSpec:
    """What the feed says about one KV group."""

    name: str  # the engine's group name ("full" / "sliding"), as events carry it
    sliding_window: int | None  # its window in tokens; None for full attention

    @property
    def kind(self) -> str:
        return FULL_ATTENTION_KIND if self.sliding_window is None else SLIDING_WINDOW_KIND


class KVEventTranslator:
    """Engine events -> KV events, in order: a pure function of the event stream it is given.

    Besides the progress of a reset across the groups it keeps what the disk tier's events need and do
    not carry, bounded by the pool and the tier:
      * which of the full group's cached keys hang from a namespace root (a DEMOTE names its parent's
        key, the namespace root's for a context's first block, which is published as None). A key's
        parent is fixed by the key, and a block's DEMOTE follows its EVICT in the same step (the scheduler
        takes the tier's stores at the end of the schedule that evicted), so the keys evicted in one
        `translate` call are kept until its end;
      * the keys published under "DISK" and not removed since (a TIER_DROP removes a block only if its
        DEMOTE was published; a TIER_EVICT of a block no event announced publishes nothing).

    Not thread-safe: one listener (the engine thread) calls it.
    """

    def __init__(self, groups: Sequence[GroupSpec], block_size: int, medium: str, *, disk_tier: bool = False) -> None:
        """Args:
        groups: the engine's KV groups in order (their positions are the group_idx).
        block_size: tokens per block.
        medium: MEDIUM_GPU or MEDIUM_CPU: where the pool's KV lives.
        disk_tier: whether the engine has a disk tier (then a reset never publishes AllBlocksCleared:
            the tier keeps its blocks, some of which a restarted engine found without announcing them).
        """
        if not groups:
            raise ValueError("an engine has at least one KV group")
        self.groups = tuple(groups)  # the engine's KV groups, full attention first
        self.block_size = block_size  # tokens per block
        self.medium = medium  # where the pool's KV lives
        self.disk_tier = disk_tier  # whether a disk tier keeps blocks across resets
        self._index = {group.name: index for index, group in enumerate(self.groups)}
        # the full-attention group's position: the group whose evicted blocks the disk tier takes
        self._full = next((i for i, group in enumerate(self.groups) if group.sliding_window is None), None)
        self._resetting: list[int] = []  # kept blocks of the groups reset so far in the current reset
        self._pool_first: set[str] = set()  # the full group's cached keys that hang from a namespace root
        self._on_disk: set[str] = set()  # keys published under DISK and not removed since

    def translate(self, events: Sequence[Event]) -> list[KVEvent]:
        """The KV events of `events` (engine events of other kinds translate to nothing)."""
        out: list[KVEvent] = []
        evicted_first: set[str] = set()  # first blocks the pool evicted in this call (their DEMOTE may follow)
        for event in events:
            kind = event.kind
            if kind is EventKind.CACHE:
                out.extend(self._stored(event.detail))
            elif kind is EventKind.EVICT:
                key, group_idx = event.detail["key"], self._index[event.detail["group"]]
                if group_idx == self._full and key in self._pool_first:
                    self._pool_first.discard(key)
                    evicted_first.add(key)
                out.append(BlockRemoved([external_hash(key)], self.medium, group_idx))
            elif kind is EventKind.RESET:
                self._resetting.append(event.detail["kept_blocks"])
                if len(self._resetting) == len(self.groups):  # every group's pool was reset
                    if not any(self._resetting) and not self.disk_tier:
                        out.append(AllBlocksCleared())
                    self._resetting.clear()
            elif kind is EventKind.DEMOTE:
                out.append(self._demoted(event.detail, evicted_first))
            elif kind is EventKind.TIER_EVICT or kind is EventKind.TIER_DROP:
                key = event.detail["key"]
                if key in self._on_disk:
                    self._on_disk.discard(key)
                    out.append(BlockRemoved([external_hash(key)], MEDIUM_DISK, self._full))
        return out

    def announce_disk(self, blocks: Iterable[DiskBlock]) -> list[BlockStored]:
        """BlockStored "DISK" events for blocks the disk tier holds that no event announced (a restarted
        engine's warm tier); from now on they are followed like demoted blocks."""
        stored = []
        for block in blocks:
            self._on_disk.add(block.key)
            stored.append(self._disk_stored(block))
        return stored

    def _demoted(self, detail: dict, evicted_first: set[str]) -> BlockStored:
        """The BlockStored of one block the disk tier took (the full group's, from the pool or its write-back)."""
        key = detail["key"]
        first = key in evicted_first or key in self._pool_first
        self._on_disk.add(key)
        return self._disk_stored(DiskBlock(key, None if first else detail["parent_key"], list(detail["token_ids"])))

    def _disk_stored(self, block: DiskBlock) -> BlockStored:
        """One block on the disk tier as a BlockStored (the full-attention group's: the tier holds no other)."""
        if self._full is None:
            raise ValueError("a disk-tier block from an engine without a full-attention group")
        group = self.groups[self._full]
        return BlockStored(
            block_hashes=[external_hash(block.key)],
            parent_block_hash=None if block.parent_key is None else external_hash(block.parent_key),
            token_ids=block.token_ids,
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM_DISK,
            lora_name=None,
            group_idx=self._full,
            kv_cache_spec_kind=group.kind,
            kv_cache_spec_sliding_window=group.sliding_window,
        )

    def _stored(self, detail: dict) -> list[BlockStored]:
        group_idx = self._index[detail["group"]]
        group = self.groups[group_idx]
        keys, parents, tokens = detail["keys"], detail["parent_keys"], detail["token_ids"]
        if group_idx == self._full:
            self._pool_first.update(key for key, parent in zip(keys, parents) if parent is None)
        size = self.block_size
        stored: list[BlockStored] = []
        start = 0
        for end in range(1, len(keys) + 1):
            if end < len(keys) and parents[end] == keys[end - 1]:
                continue  # the chain goes on
            parent = parents[start]
            stored.append(
                BlockStored(
                    block_hashes=[external_hash(key) for key in keys[start:end]],
                    parent_block_hash=None if parent is None else external_hash(parent),
                    token_ids=tokens[start * size : end * size],
                    block_size=size,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=None,
                    group_idx=group_idx,
                    kv_cache_spec_kind=group.kind,
                    kv_cache_spec_sliding_window=group.sliding_window,
                )
            )
            start = end
        return stored
