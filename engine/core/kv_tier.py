"""The second KV tier's index: which evicted full-attention blocks the disk tier holds, where, and in what order
it gives them up.

Pure Python: no torch, no I/O. The bytes live in the tier's files, which the runner side
(engine/runner/kv_tier_files.py, engine/runner/kv_tier_io.py) reads and writes by slot; this index decides.

How a block travels:

    pool evicts a cached block at ref 0 --offer--> pending --take_transfers--> writing (slot, TierStore)
        --writer thread confirms (TierWrite with its checksum)--> ready: found by `find`, in the LRU order
    a lookup past the pool's hit --find--> ready entries along the context's chain --plan_loads--> TierLoad
        into fresh pool blocks, executed before the forward, like copy-on-write copies

Every slot is in exactly one state:

    free      no entry; in the free list
    writing   an entry whose bytes the writer has not confirmed; never found, never evicted
    ready     an entry whose bytes and checksum the writer confirmed; found by lookups, evicted in LRU order

Invariants (checked by `check_invariants`):
  * the free slots and the entries' slots are disjoint and cover [0, num_slots); one entry per key, per slot;
  * the LRU order holds exactly the ready entries; a writing entry has no checksum, a ready one has one;
  * pinned entries (loads planned since the last `take_transfers`) are ready, so the slot a load reads is
    never handed to a store before the load has run;
  * an entry is found only under its own key, parent key and token ids: the chain key folds in the
    namespace (model, weights, dtype, block size, attention spec) and the salt, exactly as in the pool.

Eviction order (`TIER_POLICIES`, `EngineConfig.offload_policy`):
  * lru (the default): the least recently used ready entry (stored, promoted or re-offered) goes first;
  * reuse-lru: a segmented LRU, the tier's form of the pool's reuse-LRU: an entry promoted at least once
    moves to a protected segment (at most PROTECTED_SHARE of the slots; its oldest overflow goes back to
    the newest end of the other one), and victims come from the unprotected entries first, so a stream of
    blocks stored once and never reused cannot push out the blocks that are.

A full tier evicts the policy's first unpinned ready entry for a new store; when none is ready (every slot is
being written) or the writer's queue is full, the store is dropped and counted: the pool's eviction goes on
as plain eviction and no step waits for the disk.
"""

from __future__ import annotations

import queue
from collections import OrderedDict
from itertools import chain
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple, Sequence

from engine.core.block import Block
from engine.core.chain_keys import ChainKeys
from engine.core.errors import InvariantError, require
from engine.core.events import EventKind, EventLog, TierReason


@dataclass(slots=True)
class TierEntry:
    """One block the tier holds (or is writing)."""

    key: bytes  # its chain key
    parent_key: bytes  # the key its chain hangs from (the namespace root for block 0)
    token_ids: tuple[int, ...]  # the block's tokens, confirmed on every lookup
    slot: int  # where its bytes are in the tier's files
    checksum: int | None  # of its bytes, once the writer confirmed them; None while writing
    stamp: int  # store order (the persisted LRU order after a restart)


class TierStore(NamedTuple):
    """Copy pool block `block_id`'s K/V into tier slot `slot` (before the step's forward rewrites the block)."""

    block_id: int
    slot: int
    key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]
    stamp: int


class TierLoad(NamedTuple):
    """Read tier slot `slot` into pool block `block_id` for `request_id`, checking `checksum` first."""

    request_id: str
    slot: int
    block_id: int
    key: bytes
    checksum: int


class TierWrite(NamedTuple):
    """The writer's word on one store: `checksum` of the bytes written, or None when it dropped them."""

    slot: int
    key: bytes
    checksum: int | None


class TierTransfers(NamedTuple):
    """One step's tier work, executed before its forward: stores first, then loads."""

    stores: Sequence[TierStore]
    loads: Sequence[TierLoad]


NO_TRANSFERS = TierTransfers((), ())


@dataclass(frozen=True, slots=True)
class TierStats:
    """The disk tier's counters (engine/core/snapshot.py's `PoolStats.tier`)."""

    num_slots: int  # blocks the tier can hold
    ready_blocks: int  # blocks it holds and serves
    writing_blocks: int  # blocks being written
    hit_tokens: int  # prompt tokens promoted from the tier instead of computed
    stores: int  # blocks written
    loads: int  # blocks promoted into the pool
    bytes_written: int
    bytes_read: int
    drops: int  # evicted blocks not stored: the tier was full of blocks being written, or the writer's queue was
    corrupt: int  # loads whose checksum did not match: reported and recomputed, never served
    evictions: int  # ready blocks the tier gave up for newer ones


TIER_POLICIES = ("lru", "reuse-lru")
PROTECTED_SHARE = 0.75  # reuse-lru: the most of the tier's slots the promoted-at-least-once entries keep


class TierIndex:
    """The disk tier's bookkeeping: entries by key, free slots, the LRU order, pending stores and loads."""

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        slot_bytes: int,
        writes: queue.SimpleQueue[TierWrite],
        log: EventLog | None = None,
        policy: str = "lru",
    ) -> None:
        """Args:
            num_slots: blocks the tier's files hold (>= 1).
            block_size: tokens per block.
            slot_bytes: bytes of one block's K/V in the tier (for the byte counters).
            writes: where the writer thread reports each store (`settle` drains it).
            log: where the tier's DEMOTE, PROMOTE, TIER_EVICT and TIER_DROP events go (engine/core/events.py);
                None: a log that keeps nothing.
            policy: the eviction order, one of TIER_POLICIES (see the module docstring).
        """
        if num_slots < 1 or block_size < 1 or slot_bytes < 1:
            raise ValueError("a tier needs at least one slot, a block size and a slot size")
        if policy not in TIER_POLICIES:
            raise ValueError(f"the disk tier's policy is one of {', '.join(TIER_POLICIES)}, got {policy!r}")
        self.policy = policy
        self._protected_cap = int(num_slots * PROTECTED_SHARE) if policy == "reuse-lru" else 0
        self.num_slots = num_slots
        self.block_size = block_size
        self.slot_bytes = slot_bytes
        self._writes = writes
        self._log = log if log is not None else EventLog(recording=False)
        self._entries: dict[bytes, TierEntry] = {}  # key -> entry, writing or ready
        # The ready entries, least recently used first, in two segments: `_protected` (reuse-lru: promoted at
        # least once; always empty under lru) and `_lru` (the others).
        self._lru: OrderedDict[bytes, TierEntry] = OrderedDict()
        self._protected: OrderedDict[bytes, TierEntry] = OrderedDict()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # free slots, popped from the end
        self._pending: list[tuple[int, bytes, bytes, tuple[int, ...]]] = []  # offered since the last take
        self._pinned: set[bytes] = set()  # keys of entries a planned load reads
        self._loads: list[TierLoad] = []
        self._stamp = 0
        self.hit_tokens = self.stores = self.loads = self.drops = self.corrupt = self.evictions = 0

    # ------------------------------------------------------------------ restore
    def restore(self, entries: Sequence[TierEntry]) -> None:
        """Take the ready entries a previous engine left in the tier's files (oldest store first).

        Raises:
            ValueError: the index is not empty, a slot is out of range or given twice, or a key twice.
        """
        if self._entries:
            raise ValueError("restore into an empty tier index only")
        slots = {entry.slot for entry in entries}
        keys = {entry.key for entry in entries}
        if len(slots) != len(entries) or len(keys) != len(entries) or any(not 0 <= s < self.num_slots for s in slots):
            raise ValueError("restored tier entries repeat a slot or a key, or lie outside the tier")
        for entry in sorted(entries, key=lambda e: e.stamp):
            if entry.checksum is None or len(entry.token_ids) != self.block_size:
                raise ValueError(f"restored tier entry in slot {entry.slot} is not a whole, written block")
            self._entries[entry.key] = self._lru[entry.key] = entry
            self._stamp = max(self._stamp, entry.stamp + 1)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in slots]

    # ------------------------------------------------------------------ the pool's side
    def offer(self, block: Block) -> None:
        """The pool is dropping this unreferenced cached block (its `on_evict`): store it at the next
        `take_transfers` unless the tier holds its key already."""
        key, parent_key = block.key, block.parent_key
        if key is None or parent_key is None or len(block.token_ids) != self.block_size:
            return
        if key in self._lru:
            self._lru.move_to_end(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        elif key not in self._entries:
            self._pending.append((block.block_id, key, parent_key, tuple(block.token_ids)))

    def find(self, keys: ChainKeys, token_ids: list[int], first: int, end: int) -> list[TierEntry]:
        """The ready entries holding the context's full blocks `first`, `first + 1`, ... (before `end`), in
        order, up to the first block the tier does not hold. Changes nothing.

        Each entry must hold exactly that block's tokens under the previous block's key, as a pool hit does.
        """
        bs = self.block_size
        found: list[TierEntry] = []
        for i in range(first, end):
            key = keys.key(i, token_ids)
            entry = self._ready(key)
            parent = keys.key(i - 1, token_ids) if i else keys.root_key
            if entry is None or entry.parent_key != parent or list(entry.token_ids) != token_ids[i * bs : (i + 1) * bs]:
                break
            found.append(entry)
        return found

    def plan_loads(self, request_id: str, entries: Sequence[TierEntry], block_ids: Sequence[int]) -> None:
        """Promote `entries` into the request's fresh pool blocks `block_ids` (same order) before the next
        forward; they stay pinned (never evicted) until `take_transfers`.

        Raises:
            InvariantError: an entry is not ready, or the lists differ in length; nothing changes.
        """
        require(len(entries) == len(block_ids), f"{request_id}: {len(entries)} tier entries, {len(block_ids)} blocks")
        for entry in entries:
            require(self._ready(entry.key) is entry, f"{request_id}: a planned tier load is not ready")
        for entry, block_id in zip(entries, block_ids):
            self._used(entry)
            self._pinned.add(entry.key)
            self._loads.append(TierLoad(request_id, entry.slot, block_id, entry.key, entry.checksum or 0))
        self.loads += len(entries)
        self.hit_tokens += len(entries) * self.block_size
        if entries:
            detail = {
                "block_ids": list(block_ids),
                "keys": [entry.key.hex() for entry in entries],
                "slots": [entry.slot for entry in entries],
            }
            tokens = len(entries) * self.block_size
            self._log.emit(EventKind.PROMOTE, detail, request_id=request_id, block_id=block_ids[0], tokens=tokens)

    def take_transfers(self) -> TierTransfers:
        """The step's stores (a slot for each block offered since the last call, or a drop) and its planned
        loads; unpins the loads' entries (the runner executes them before the forward)."""
        stores: list[TierStore] = []
        for block_id, key, parent_key, token_ids in self._pending:
            if key in self._entries:
                continue
            slot = self._free_slot()
            if slot is None:
                self.drops += 1
                self._log.emit(EventKind.TIER_DROP, {"key": key.hex(), "reason": TierReason.FULL.value}, block_id=block_id)
                continue
            entry = TierEntry(key, parent_key, token_ids, slot, None, self._stamp)
            self._entries[key] = entry
            stores.append(TierStore(block_id, slot, key, parent_key, token_ids, self._stamp))
            self._stamp += 1
            detail = {"key": key.hex(), "parent_key": parent_key.hex(), "slot": slot, "token_ids": list(token_ids)}
            self._log.emit(EventKind.DEMOTE, detail, block_id=block_id, tokens=self.block_size)
        self._pending = []
        loads, self._loads = self._loads, []
        self._pinned.clear()
        return TierTransfers(stores, loads) if stores or loads else NO_TRANSFERS

    def _free_slot(self) -> int | None:
        """A free slot, or the least recently used unpinned ready entry's (evicted); None when neither."""
        if self._free:
            return self._free.pop()
        for key, entry in chain(self._lru.items(), self._protected.items()):
            if key not in self._pinned:
                self._forget_ready(key)
                del self._entries[key]
                self.evictions += 1
                detail = {"key": key.hex(), "slot": entry.slot, "reason": TierReason.LRU.value}
                self._log.emit(EventKind.TIER_EVICT, detail, tokens=self.block_size)
                return entry.slot
        return None

    # ------------------------------------------------------------------ the writer's and the loader's reports
    def settle(self) -> None:
        """Apply every store the writer thread has reported since the last call."""
        while True:
            try:
                write = self._writes.get_nowait()
            except queue.Empty:
                return
            self.complete(write)

    def complete(self, write: TierWrite) -> None:
        """One store is on disk (ready from now on) or was dropped (its slot is free again)."""
        entry = self._entries.get(write.key)
        if entry is None or entry.slot != write.slot or entry.checksum is not None:
            raise InvariantError(f"a tier write nobody planned (slot {write.slot})")
        if write.checksum is None:
            del self._entries[write.key]
            self._free.append(write.slot)
            self.drops += 1
            self._log.emit(EventKind.TIER_DROP, {"key": write.key.hex(), "reason": TierReason.WRITER.value})
            return
        entry.checksum = write.checksum
        self._lru[write.key] = entry
        self.stores += 1

    def discard(self, load: TierLoad) -> None:
        """A load's bytes did not match their checksum: the entry is gone (its block is recomputed)."""
        self.corrupt += 1
        entry = self._ready(load.key)
        if entry is not None and entry.slot == load.slot:
            self._forget_ready(load.key)
            del self._entries[load.key]
            self._free.append(load.slot)
            detail = {"key": load.key.hex(), "slot": load.slot, "reason": TierReason.CORRUPT.value}
            self._log.emit(EventKind.TIER_EVICT, detail, request_id=load.request_id, tokens=self.block_size)

    # ------------------------------------------------------------------ the eviction order
    def _ready(self, key: bytes) -> TierEntry | None:
        entry = self._lru.get(key)
        return entry if entry is not None else self._protected.get(key)

    def _used(self, entry: TierEntry) -> None:
        """A promoted entry becomes the most recently used: of the protected segment under reuse-lru (its
        oldest overflow back to the newest end of the other), of the only one under lru."""
        if not self._protected_cap:
            self._lru.move_to_end(entry.key)
            return
        self._lru.pop(entry.key, None)
        self._protected[entry.key] = entry
        self._protected.move_to_end(entry.key)
        while len(self._protected) > self._protected_cap:
            key, oldest = self._protected.popitem(last=False)
            self._lru[key] = oldest

    def _forget_ready(self, key: bytes) -> None:
        if self._lru.pop(key, None) is None:
            del self._protected[key]

    # ------------------------------------------------------------------ inspection
    def entries(self, limit: int) -> list[TierEntry]:
        """The ready entries, most recently used first, at most `limit` of them (for the console's views).
        Changes nothing; the entries are the index's own: read them, never change them."""
        newest = chain(reversed(self._protected.values()), reversed(self._lru.values()))
        return list(islice(newest, max(0, limit)))

    def stats(self) -> TierStats:
        ready = len(self._lru) + len(self._protected)
        return TierStats(
            num_slots=self.num_slots,
            ready_blocks=ready,
            writing_blocks=len(self._entries) - ready,
            hit_tokens=self.hit_tokens,
            stores=self.stores,
            loads=self.loads,
            bytes_written=self.stores * self.slot_bytes,
            bytes_read=self.loads * self.slot_bytes,
            drops=self.drops,
            corrupt=self.corrupt,
            evictions=self.evictions,
        )

    def check_invariants(self) -> None:
        """Raise InvariantError if an invariant of the module docstring is broken."""
        slots = [entry.slot for entry in self._entries.values()]
        require(len(set(slots)) == len(slots), "two tier entries share a slot")
        require(len(set(self._free)) == len(self._free), "a free tier slot is listed twice")
        require(set(slots).isdisjoint(self._free), "a tier slot is both free and held")
        require(len(slots) + len(self._free) == self.num_slots, "tier slots lost or invented")
        require(all(0 <= s < self.num_slots for s in [*slots, *self._free]), "a tier slot out of range")
        require(set(self._lru).isdisjoint(self._protected), "a tier entry in both segments")
        require(len(self._protected) <= self._protected_cap, "the protected segment outgrew its share")
        for key, entry in self._entries.items():
            require(entry.key == key, "a tier entry under another key")
            ready = self._ready(key)
            require((entry.checksum is not None) == (ready is not None), "ready tier entries and the LRU disagree")
            require(ready is None or ready is entry, "the LRU holds another entry for a key")
        require(set(self._lru) | set(self._protected) <= set(self._entries), "the LRU holds an entry the index lost")
        require(all(self._ready(key) is not None for key in self._pinned), "a pinned tier entry is not ready")
