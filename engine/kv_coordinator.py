"""Keeps the KV groups of one engine in step.

Pure Python: no torch. Every request has a table in every group or in none. Allocation is all or
nothing across groups: the coordinator checks that each group can supply its blocks before any of
them changes. A full-attention model has one group and behaves exactly like a single manager.

Per group, a chunk writes K/V only for positions at or after the group's `write_from`: during an
exact or approximate replay the full group already holds [r, h), so only the sliding group writes there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.block_pool import Block
from engine.events import EventKind, EventLog
from engine.kv_cache_manager import BlockCopy, KVCacheManager, TableStart
from engine.kv_groups import (
    FULL,
    SLIDING,
    HitPlan,
    KVGroupSpec,
    WindowPolicy,
    chain_keys_of,
    plan_sliding_only_hit,
    plan_window_hit,
)


@dataclass(frozen=True, slots=True)
class GroupSlots:
    """One group's view of a scheduled chunk, for the runner."""

    block_ids: list[int]  # physical blocks of logical blocks first_block, first_block + 1, ...
    first_block: int  # logical index of block_ids[0]; keys before first_block * block_size are not visible
    write_from: int  # positions below this already hold K/V in this group: the chunk does not write them


class KVCoordinator:
    def __init__(
        self, specs: Sequence[KVGroupSpec], managers: Sequence[KVCacheManager], policy: WindowPolicy, log: EventLog
    ) -> None:
        if [s.name for s in specs] != [m.pool.group for m in managers]:
            raise ValueError("one manager per group spec, in the same order")
        self.specs = tuple(specs)
        self.managers = tuple(managers)
        self.policy = policy
        self._log = log
        self.block_size = managers[0].block_size
        self._by_name = {m.pool.group: m for m in managers}

    @property
    def full(self) -> KVCacheManager | None:
        return self._by_name.get(FULL)

    @property
    def sliding(self) -> KVCacheManager | None:
        return self._by_name.get(SLIDING)

    # ------------------------------------------------------------------ reading
    def has_table(self, request_id: str) -> bool:
        return self.managers[0].has_table(request_id)

    def num_tokens(self, request_id: str) -> int:
        """Tokens whose K/V every group holds (the request's computed length)."""
        return max(m.num_tokens(request_id) for m in self.managers)

    def block_ids(self, request_id: str) -> dict[str, list[int]]:
        return {m.pool.group: m.block_ids(request_id) for m in self.managers}

    # ------------------------------------------------------------------ hits
    def plan_hit(self, token_ids: list[int], salt: str | None) -> HitPlan:
        """Decide what a new request reuses (no side effects; pass the plan to `admit`)."""
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        full, sliding = self.full, self.sliding
        if sliding is None:
            hits = full.find_prefix_hit(token_ids, salt)  # type: ignore[union-attr]
            h = len(hits) * bs
            keys = [b.key for b in hits]  # type: ignore[misc]
            return HitPlan(h, 0, 0, h, "full" if h else "none", keys, full_hits=hits)
        root = self.managers[0].root_key(salt)
        for manager in self.managers[1:]:
            manager.root_key(salt)
        if full is not None:
            full_hits = full.find_prefix_hit(token_ids, salt)
            keys = [b.key for b in full_hits]  # type: ignore[misc]
            h_blocks = len(full_hits)
        else:
            full_hits = []
            keys = chain_keys_of(token_ids, root, bs, max_blocks)
            h_blocks = max_blocks
        sliding_blocks = self._sliding_blocks(token_ids, keys[:h_blocks], root)
        present = [b is not None for b in sliding_blocks]
        window = sliding.window
        if full is not None:
            h, s, e, r, mode = plan_window_hit(h_blocks, present, window, bs, self.policy)  # type: ignore[arg-type]
        else:
            h, s, e, r, mode = plan_sliding_only_hit(present, window, bs)  # type: ignore[arg-type]
        if mode == "approximate":
            offset = r // bs
        else:
            offset = max(0, r - window + 1) // bs  # type: ignore[operator]
        return HitPlan(
            h,
            s,
            e,
            r,
            mode,
            keys[: max(h_blocks, r // bs)],
            full_hits=full_hits[: h // bs],
            sliding_offset=offset,
            sliding_hits=[b for b in sliding_blocks[offset : r // bs]],  # type: ignore[misc]
        )

    def _sliding_blocks(self, token_ids: list[int], keys: list[bytes], root: bytes) -> list[Block | None]:
        bs, lookup = self.block_size, self.sliding.pool.lookup  # type: ignore[union-attr]
        found: list[Block | None] = []
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else root
            found.append(lookup(key, parent, token_ids[i * bs : (i + 1) * bs]))
        return found

    # ------------------------------------------------------------------ allocation
    def admit(self, request_id: str, token_ids: list[int], plan: HitPlan, salt: str | None) -> tuple[int, ...] | None:
        """First allocation of a new request: share the plan's hits, reserve slots for `token_ids`.

        `token_ids` are the tokens of the first chunk, starting at position `plan.r`.

        Returns:
            Per group, the first position the chunk writes; None (nothing changed) when the pool lacks blocks.
        """
        starts = []
        for manager in self.managers:
            if manager.window is None:
                hits, start, first = plan.full_hits, None, plan.h
            else:
                hits, first = plan.sliding_hits, plan.r
                start = TableStart(plan.sliding_offset, plan.chain_keys)
            new = token_ids[max(0, first - plan.r) :]
            starts.append((manager, new, hits, start, max(first, plan.r)))
        if any(m.num_blocks_needed(request_id, len(new), hits) > m.pool.num_allocatable for m, new, hits, _, _ in starts):
            return None
        for manager, new, hits, start, _ in starts:
            assert manager.allocate_slots(request_id, new, hits=hits, salt=salt, start=start)
        if plan.mode in ("exact", "approximate"):
            self._log.emit(
                EventKind.REPLAY,
                request_id=request_id,
                tokens=plan.replayed_tokens,
                detail={
                    "h": plan.h,
                    "s": plan.s,
                    "e": plan.e,
                    "r": plan.r,
                    "mode": plan.mode,
                    "replayed_tokens": plan.replayed_tokens,
                },
            )
        return tuple(write_from for *_, write_from in starts)

    def allocate(self, request_id: str, start_pos: int, token_ids: list[int]) -> tuple[int, ...] | None:
        """Reserve slots for a chunk at `start_pos` of a request that already has tables.

        Returns:
            Per group, the first position the chunk writes; None (nothing changed) when blocks are short.
        """
        plans = []
        for manager in self.managers:
            held = manager.num_tokens(request_id)
            skip = max(0, held - start_pos)
            plans.append((manager, token_ids[skip:], max(held, start_pos)))
        if any(m.num_blocks_needed(request_id, len(new)) > m.pool.num_allocatable for m, new, _ in plans):
            return None
        for manager, new, _ in plans:
            assert manager.allocate_slots(request_id, new)
        return tuple(write_from for *_, write_from in plans)

    def slots(self, request_id: str, write_from: tuple[int, ...]) -> tuple[GroupSlots, ...]:
        """Per group, the request's table as the runner reads it."""
        return tuple(
            GroupSlots(m.block_ids(request_id), m.offset(request_id), w) for m, w in zip(self.managers, write_from)
        )

    def take_copies(self) -> tuple[list[BlockCopy], ...]:
        return tuple(m.take_copies() for m in self.managers)

    # ------------------------------------------------------------------ after a forward, forks, release
    def finish_chunk(self, request_id: str, *, cacheable: bool) -> None:
        """Offer newly full blocks to every group's index, then release blocks outside the window.

        Args:
            request_id: the request whose chunk was computed.
            cacheable: False for state derived from an approximate replay: it is not what a from-scratch
                run computes, so it must never be hit (its blocks stay private and are freed, not cached).
        """
        for manager in self.managers:
            manager.cache_full_blocks(request_id, offer=cacheable)
            manager.release_outside_window(request_id)

    def fork(self, parent_id: str, child_id: str) -> int:
        shared = [m.fork(parent_id, child_id) for m in self.managers]
        return max(shared)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)

    def reset_prefix_cache(self) -> tuple[int, int]:
        results = [m.reset_prefix_cache() for m in self.managers]
        return sum(d for d, _ in results), sum(k for _, k in results)

    def check_invariants(self) -> None:
        for manager in self.managers:
            manager.check_invariants()
        tables = [set(m.tables()) for m in self.managers]
        assert all(t == tables[0] for t in tables), "a request has tables in some groups only"
