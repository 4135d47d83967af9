"""Keeps the KV groups of one engine in step.

Pure Python: no torch. Every request has a table in every group or in none. Allocation is all or
nothing across groups, as a check and a commit: `can_admit` / `admit` give a new request its tables,
`can_append` / `append` grow them; the check answers whether every group can supply its blocks, and the
commit (which raises `NoFreeBlocksError`, nothing changed, when called without room) changes them all.
A full-attention model has one group and behaves exactly like a single manager.

Per group, a chunk writes K/V only for positions at or after the group's `write_from`: during an
exact or approximate replay the full group already holds [r, h), so only the sliding group writes there.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from engine.core.block import Block
from engine.core.errors import NoFreeBlocksError, require
from engine.core.events import EventKind, EventLog
from engine.core.kv_cache_manager import BlockCopy, KVCacheManager, TableStart
from engine.core.namespace import CONTENT_ROOT_KEY
from engine.core.request import PromptKeys
from engine.core.kv_groups import (
    FULL,
    SLIDING,
    HitPlan,
    KVGroupSpec,
    ReplayMode,
    WindowHit,
    WindowPolicy,
    chain_keys_of,
    max_hit_blocks,
    plan_sliding_only_hit,
    plan_window_hit,
)


class Reservation(NamedTuple):
    """What `admit` or `append` reserved for one chunk."""

    write_from: tuple[int, ...]  # per group: the first position the chunk writes (see the module docstring)
    num_copies: int  # copy-on-write copies made (a shared partial tail written into), over all groups


class GroupTable(NamedTuple):
    """One group's table of one request, as plain data for the runner."""

    block_ids: list[int]  # physical blocks of logical blocks first_block, first_block + 1, ...
    first_block: int  # logical index of block_ids[0]


class _GroupAdmission(NamedTuple):
    """One group's share of an admission."""

    manager: KVCacheManager
    skip: int  # leading tokens of the first chunk this group already holds (hit blocks), so does not write
    hits: Sequence[Block]
    start: TableStart | None
    write_from: int


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

    @property
    def ready_mode(self) -> ReplayMode:
        """The mode of a hit that needs no replay in this model (a fork child's, for one)."""
        return ReplayMode.FULL if self.sliding is None else ReplayMode.READY

    # ------------------------------------------------------------------ reading
    def has_table(self, request_id: str) -> bool:
        return self.managers[0].has_table(request_id)

    def num_tokens(self, request_id: str) -> int:
        """Tokens whose K/V every group holds (the request's computed length). During a replay that takes
        more than one chunk the full group holds more (its hit reaches h); the sliding group's is the length."""
        return min(m.num_tokens(request_id) for m in self.managers)

    def block_ids(self, request_id: str) -> dict[str, tuple[int, ...]]:
        """Per group, the blocks the request holds (a copy; empty where it holds none)."""
        return {
            m.pool.group: tuple(m.live_block_ids(request_id)[0]) if m.has_table(request_id) else ()
            for m in self.managers
        }

    def prompt_keys(self, request_id: str, prompt_token_ids: Sequence[int]) -> PromptKeys:
        """What the history keeps of a request's prompt (engine/core/request.py's `PromptKeys`): its table's
        chain keys of the prompt's full blocks (every group chains the same keys), and their content keys.
        Call while the request holds its tables and has computed its prompt."""
        num = len(prompt_token_ids) // self.block_size
        chain = self.managers[0].chain_keys(request_id)[:num]
        require(len(chain) == num, f"{request_id}: the prompt's full blocks are not all keyed")
        content = chain_keys_of(list(prompt_token_ids), CONTENT_ROOT_KEY, self.block_size, num)
        return PromptKeys(b"".join(chain), b"".join(content))

    def group_tables(self, request_id: str) -> tuple[GroupTable, ...]:
        """Per group, the request's table as the runner reads it in this step (the lists are not copied)."""
        return tuple(GroupTable(*m.live_block_ids(request_id)) for m in self.managers)

    # ------------------------------------------------------------------ hits
    def plan_hit(self, token_ids: list[int], salt: str | None) -> HitPlan:
        """Decide what a new request reuses (no side effects; pass the plan to `admit`)."""
        bs = self.block_size
        max_blocks = max_hit_blocks(len(token_ids), bs)
        full, sliding = self.full, self.sliding
        if sliding is None:
            hits = full.find_prefix_hit(token_ids, salt)  # type: ignore[union-attr]
            h = len(hits) * bs
            mode = ReplayMode.FULL if h else ReplayMode.NONE
            keys = [b.key for b in hits]
            return HitPlan(h=h, s=0, e=0, r=h, mode=mode, chain_keys=keys, full_hits=hits)  # type: ignore[arg-type]
        root = self.managers[0].root_key(salt)
        for manager in self.managers[1:]:
            manager.root_key(salt)
        if full is not None:
            full_hits = full.find_prefix_hit(token_ids, salt)
            keys = [b.key for b in full_hits]
            h_blocks = len(full_hits)
        else:
            full_hits = []
            keys = chain_keys_of(token_ids, root, bs, max_blocks)
            h_blocks = max_blocks
        sliding_blocks = self._sliding_blocks(token_ids, keys[:h_blocks], root)  # type: ignore[arg-type]
        present = [b is not None for b in sliding_blocks]
        window = sliding.window
        hit: WindowHit
        if full is not None:
            hit = plan_window_hit(h_blocks, present, window, bs, self.policy)  # type: ignore[arg-type]
        else:
            hit = plan_sliding_only_hit(present, window, bs)  # type: ignore[arg-type]
        if hit.mode is ReplayMode.APPROXIMATE:
            offset = hit.r // bs
        else:
            offset = max(0, hit.r - window + 1) // bs  # type: ignore[operator]
        return HitPlan(
            h=hit.h,
            s=hit.s,
            e=hit.e,
            r=hit.r,
            mode=hit.mode,
            chain_keys=keys[: max(h_blocks, hit.r // bs)],  # type: ignore[arg-type]
            full_hits=full_hits[: hit.h // bs],
            sliding_offset=offset,
            sliding_hits=sliding_blocks[offset : hit.r // bs],  # type: ignore[arg-type]
        )

    def _sliding_blocks(self, token_ids: list[int], keys: list[bytes], root: bytes) -> list[Block | None]:
        bs, lookup = self.block_size, self.sliding.pool.lookup  # type: ignore[union-attr]
        found: list[Block | None] = []
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else root
            found.append(lookup(key, parent, token_ids[i * bs : (i + 1) * bs]))
        return found

    # ------------------------------------------------------------------ admission and growth
    def can_admit(self, plan: HitPlan, num_tokens: int) -> bool:
        """Whether `admit` can give a new request its tables: the plan's hits and a first chunk of
        `num_tokens` tokens from position `plan.r`."""
        return all(
            group.manager.can_allocate(max(0, num_tokens - group.skip), group.hits) for group in self._admission(plan)
        )

    def admit(self, request_id: str, token_ids: list[int], plan: HitPlan, salt: str | None) -> Reservation:
        """First allocation of a new request: share the plan's hits, reserve slots for `token_ids`.

        `token_ids` are the tokens of the first chunk, starting at position `plan.r`.

        Raises:
            NoFreeBlocksError: `can_admit` says no; no group changes.
        """
        if not self.can_admit(plan, len(token_ids)):
            raise NoFreeBlocksError(f"{request_id}: not enough blocks to admit {len(token_ids)} tokens")
        groups = self._admission(plan)
        for group in groups:
            new = token_ids[group.skip :]
            group.manager.allocate(request_id, new, hits=group.hits, salt=salt, start=group.start)
        if plan.mode in (ReplayMode.EXACT, ReplayMode.APPROXIMATE):
            detail = {
                "h": plan.h,
                "s": plan.s,
                "e": plan.e,
                "r": plan.r,
                "mode": plan.mode.value,
                "replayed_tokens": plan.replayed_tokens,
            }
            self._log.emit(EventKind.REPLAY, detail, request_id=request_id, tokens=plan.replayed_tokens)
        return Reservation(tuple(group.write_from for group in groups), 0)

    def _admission(self, plan: HitPlan) -> list[_GroupAdmission]:
        """Per group: the full group shares the hits [0, h) and writes from h; the sliding group shares
        its window blocks up to r and writes from r (the first chunk starts at r)."""
        groups = []
        for manager in self.managers:
            if manager.window is None:
                hits, start, first = plan.full_hits, None, plan.h
            else:
                hits, first = plan.sliding_hits, plan.r
                start = TableStart(plan.sliding_offset, plan.chain_keys)
            groups.append(_GroupAdmission(manager, max(0, first - plan.r), hits, start, max(first, plan.r)))
        return groups

    def can_append(self, request_id: str, start_pos: int, num_tokens: int) -> bool:
        """Whether `append` can reserve a chunk of `num_tokens` tokens at `start_pos` in every group."""
        for manager in self.managers:
            skip = max(0, manager.num_tokens(request_id) - start_pos)
            if not manager.can_append(request_id, max(0, num_tokens - skip)):
                return False
        return True

    def append(self, request_id: str, start_pos: int, token_ids: list[int]) -> Reservation:
        """Reserve slots for a chunk at `start_pos` of a request that already has tables.

        Raises:
            NoFreeBlocksError: `can_append` says no; no group changes.
        """
        if not self.can_append(request_id, start_pos, len(token_ids)):
            raise NoFreeBlocksError(f"{request_id}: not enough blocks for {len(token_ids)} more tokens")
        write_from = []
        num_copies = 0
        for manager in self.managers:
            held = manager.num_tokens(request_id)
            num_copies += manager.append(request_id, token_ids[max(0, held - start_pos) :])
            write_from.append(max(held, start_pos))
        return Reservation(tuple(write_from), num_copies)

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
        """Give the child a table sharing the parent's in every group. Returns the tokens every group shares."""
        return min(m.fork(parent_id, child_id) for m in self.managers)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)

    def reset_prefix_cache(self) -> tuple[int, int]:
        results = [m.reset_prefix_cache() for m in self.managers]
        return sum(d for d, _ in results), sum(k for _, k in results)

    def check_invariants(self) -> None:
        """Raise InvariantError if a group's invariants are broken or a request has tables in some groups only."""
        for manager in self.managers:
            manager.check_invariants()
        tables = [set(m.tables()) for m in self.managers]
        require(all(t == tables[0] for t in tables), "a request has tables in some groups only")
