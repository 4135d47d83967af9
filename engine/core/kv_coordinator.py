"""Keeps the KV groups of one engine in step.

Pure Python: no torch. Every request has a table in every group or in none. Allocation is all or
nothing across groups, as a check and a commit: `plan_admission` / `admit` give a new request its
tables, `plan_append` / `append` grow them. The check asks each group's pool once whether it can
supply that group's blocks and returns what the commit needs (`KVAdmission`, `KVGrowth`); the commit
takes it and changes every group without asking again. A full-attention model has one group and
behaves exactly like a single manager. (vLLM v1 calls this part `KVCacheCoordinator`.)

Every group chains the same keys from the same namespace root: `roots` binds each salt's root in every
group's pool, and the hit plan carries the root its caller resolved to every group's new table.

Per group, a chunk writes K/V only for positions at or after the group's `write_from`: during an
exact or approximate replay the full group already holds [r, h), so only the sliding group writes there.

With a disk tier (engine/core/kv_tier.py) a lookup goes on where the full group's pool hit ends, along the
same chain keys in the tier's index; the blocks found there (`HitPlan.tier_hits`) count as hits: the full
group allocates fresh blocks for them and the runner reads their K/V in before the forward
(`take_tier_transfers`). Only the full group uses the tier: a hybrid model's sliding group finds its window
state in its own pool, so a hit that reaches into the tier follows the replay-boundary rules of any hit.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from engine.core.block import Block
from engine.core.chain_keys import ChainKeys
from engine.core.errors import InvariantError, require
from engine.core.events import EventKind, EventLog
from engine.core.full_attention_manager import FullAttentionManager
from engine.core.single_type_kv_cache_manager import BlockCopy, HitShare, SingleTypeKVCacheManager
from engine.core.kv_tier import TierEntry, TierIndex, TierTransfers, NO_TRANSFERS
from engine.core.kv_groups import (
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
from engine.core.namespace import CONTENT_ROOT_KEY, NamespaceRoots
from engine.core.request import PromptKeys
from engine.core.sliding_window_manager import SlidingWindowManager


class Reservation(NamedTuple):
    """What `admit` or `append` reserved for one chunk."""

    write_from: tuple[int, ...]  # per group: the first position the chunk writes (see the module docstring)
    num_copies: int  # copy-on-write copies made (a shared partial tail written into), over all groups


class GroupTable(NamedTuple):
    """One group's table of one request, as plain data for the runner."""

    block_ids: list[int]  # physical blocks of logical blocks first_block, first_block + 1, ...
    first_block: int  # logical index of block_ids[0]


class GroupAdmission(NamedTuple):
    """One group's share of an admission."""

    manager: SingleTypeKVCacheManager
    share: HitShare  # what the group's new table shares, and where the group writes from
    skip: int  # leading tokens of the first chunk this group already holds (hit blocks), so does not write


class KVAdmission(NamedTuple):
    """`plan_admission`'s yes: every group has room for the plan's hits and a first chunk of `num_tokens`
    tokens from `plan.r`. `admit` commits exactly this."""

    plan: HitPlan
    num_tokens: int
    groups: tuple[GroupAdmission, ...]  # in the coordinator's group order


class GroupGrowth(NamedTuple):
    """One group's share of a chunk appended to existing tables."""

    manager: SingleTypeKVCacheManager
    skip: int  # leading tokens of the chunk this group already holds, so does not write
    write_from: int  # the first position the group writes


class KVGrowth(NamedTuple):
    """`plan_append`'s yes: every group has room for a chunk of `num_tokens` tokens at `start_pos` of the
    request's tables. `append` commits exactly this."""

    request_id: str
    start_pos: int
    num_tokens: int
    groups: tuple[GroupGrowth, ...]  # in the coordinator's group order


class KVShare(NamedTuple):
    """`plan_share`'s yes: a new request can share the holder's first `num_blocks` blocks and take a first
    chunk of `num_tokens` tokens after them. `share` commits exactly this."""

    holder_id: str
    num_blocks: int
    num_tokens: int
    plan: HitPlan  # the hit it amounts to: [0, num_blocks * block_size) reused, computed from there on


class KVCoordinator:
    def __init__(
        self,
        specs: Sequence[KVGroupSpec],
        managers: Sequence[SingleTypeKVCacheManager],
        policy: WindowPolicy,
        log: EventLog,
        tier: TierIndex | None = None,
    ) -> None:
        """`tier`: the disk tier's index behind the full group's pool (None: no second tier)."""
        if not managers or [s.name for s in specs] != [m.pool.group for m in managers]:
            raise ValueError("one manager per group spec, in the same order")
        self.specs = tuple(specs)
        self.managers = tuple(managers)
        self.policy = policy
        self._log = log
        self.block_size = managers[0].block_size
        self.full = next((m for m in managers if isinstance(m, FullAttentionManager)), None)
        self.sliding = next((m for m in managers if isinstance(m, SlidingWindowManager)), None)
        if len(managers) != (self.full is not None) + (self.sliding is not None):
            raise ValueError("at most one full-attention and one sliding-window group")
        if any(m.namespace != managers[0].namespace for m in managers):
            raise ValueError("every group of one engine under one cache namespace")
        self.roots = NamespaceRoots(managers[0].namespace, [m.pool for m in managers])
        if tier is not None:
            if self.full is None:
                raise ValueError("the disk tier holds full-attention blocks: an all-sliding model has none to offload")
            self.full.pool.on_evict = tier.offer
        self.tier = tier

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
    def plan_hit(self, token_ids: list[int], keys: ChainKeys) -> HitPlan:
        """Decide what a new request reuses; pass the plan to `plan_admission`. Changes nothing.

        Args:
            token_ids: the request's context.
            keys: the context's chain keys under its root from `roots` (`Request.lookup_keys` keeps them
                across lookups). They are extended as far as this lookup reaches; the plan carries their root.
        """
        if self.sliding is not None:
            return self._plan_window_hit(self.sliding, token_ids, keys)
        if self.full is None:
            raise ValueError("a coordinator needs a group")
        hits = self.full.find_prefix_hit(token_ids, keys)
        promoted = self._tier_hits(len(hits), token_ids, keys)
        num = len(hits) + len(promoted)
        h = num * self.block_size
        mode = ReplayMode.FULL if h else ReplayMode.NONE
        chain = keys.first(num, token_ids)
        return HitPlan(
            h=h, s=0, e=0, r=h, mode=mode, root_key=keys.root_key, chain_keys=chain, full_hits=hits, tier_hits=promoted
        )

    def _tier_hits(self, first: int, token_ids: list[int], keys: ChainKeys) -> list[TierEntry]:
        """The tier's entries for the context's full blocks from `first` (where the pool's hit ended) on,
        within the hit cap; none without a tier."""
        if self.tier is None:
            return []
        return self.tier.find(keys, token_ids, first, max_hit_blocks(len(token_ids), self.block_size))

    def settle_tier(self) -> None:
        """Apply the tier writer's reports (stores now ready or dropped); nothing without a tier."""
        if self.tier is not None:
            self.tier.settle()

    def write_back_tier(self) -> TierTransfers:
        """Offer every cached full-group block to the tier (an engine stopping: so that the next one on the
        same directory starts warm) and take the stores; the blocks stay cached in the pool."""
        if self.tier is None or self.full is None:
            return NO_TRANSFERS
        for block in self.full.pool.blocks:
            if block.key is not None:
                self.tier.offer(block)
        return self.tier.take_transfers()

    def take_tier_transfers(self) -> TierTransfers:
        """The step's tier stores and loads, for the runner to execute before the forward."""
        return NO_TRANSFERS if self.tier is None else self.tier.take_transfers()

    def _plan_window_hit(self, sliding: SlidingWindowManager, token_ids: list[int], keys: ChainKeys) -> HitPlan:
        """`plan_hit` in a model with a sliding group (hybrid, or sliding only): engine/core/kv_groups.py."""
        bs, window, full = self.block_size, sliding.window, self.full
        full_hits: list[Block] = []
        promoted: list[TierEntry] = []
        if full is not None:
            full_hits = full.find_prefix_hit(token_ids, keys)
            promoted = self._tier_hits(len(full_hits), token_ids, keys)
            h_blocks = len(full_hits) + len(promoted)
        else:
            h_blocks = max_hit_blocks(len(token_ids), bs)
        chain = keys.first(h_blocks, token_ids)
        lookup = sliding.pool.lookup
        found = [
            lookup(key, chain[i - 1] if i else keys.root_key, token_ids[i * bs : (i + 1) * bs])
            for i, key in enumerate(chain)
        ]
        present = [block is not None for block in found]
        hit: WindowHit
        if full is not None:
            hit = plan_window_hit(h_blocks, present, window, bs, self.policy)
        else:
            hit = plan_sliding_only_hit(present, window, bs)
        if hit.mode is ReplayMode.APPROXIMATE:
            offset = hit.r // bs
        else:
            offset = max(0, hit.r - window + 1) // bs
        sliding_hits = [block for block in found[offset : hit.r // bs] if block is not None]
        require(len(sliding_hits) == max(0, hit.r // bs - offset), "a planned sliding hit is not cached")
        return HitPlan(
            h=hit.h,
            s=hit.s,
            e=hit.e,
            r=hit.r,
            mode=hit.mode,
            root_key=keys.root_key,
            chain_keys=chain[: max(h_blocks, hit.r // bs)],
            full_hits=full_hits[: hit.h // bs],
            tier_hits=promoted if hit.h else [],
            sliding_offset=offset,
            sliding_hits=sliding_hits,
        )

    # ------------------------------------------------------------------ admission and growth
    def plan_admission(self, plan: HitPlan, num_tokens: int) -> KVAdmission | None:
        """Whether every group can give a new request its table: the plan's hits and a first chunk of
        `num_tokens` tokens from position `plan.r`. Asks each pool once; None when one has no room.

        Per group: the full group shares the hits [0, h) and writes from h; the sliding group shares its
        window blocks up to r and writes from r (the first chunk starts at r).
        """
        groups = []
        for manager in self.managers:
            share = manager.hit_share(plan)
            skip = max(0, share.write_from - plan.r)
            promoted = plan.tier_tokens if manager is self.full else 0  # fresh blocks the tier's hits are read into
            if not manager.can_allocate(max(0, num_tokens - skip) + promoted, share.hits):
                return None
            groups.append(GroupAdmission(manager, share, skip))
        return KVAdmission(plan, num_tokens, tuple(groups))

    def admit(self, request_id: str, token_ids: list[int], admission: KVAdmission) -> Reservation:
        """First allocation of a new request, as `plan_admission` decided: share the plan's hits and
        reserve slots for `token_ids`, the tokens of the first chunk from position `plan.r`, in tables
        under the plan's root.

        Raises:
            InvariantError: `token_ids` are not the chunk the admission was planned for; nothing changes.
        """
        require(len(token_ids) == admission.num_tokens, f"{request_id}: a chunk other than the one planned")
        plan = admission.plan
        for group in admission.groups:
            new = token_ids[group.skip :]
            hits, start = group.share.hits, group.share.start
            if plan.tier_hits and group.manager is self.full:
                new = [token for entry in plan.tier_hits for token in entry.token_ids] + new
            group.manager.allocate(request_id, new, root_key=plan.root_key, hits=hits, start=start)
        if plan.tier_hits and self.tier is not None and self.full is not None:
            first = len(plan.full_hits)
            targets = self.full.live_block_ids(request_id)[0][first : first + len(plan.tier_hits)]
            self.tier.plan_loads(request_id, plan.tier_hits, targets)
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
        write_from = tuple(max(group.share.write_from, plan.r) for group in admission.groups)
        return Reservation(write_from, 0)

    # ------------------------------------------------------------------ in-flight hits
    @property
    def shares_in_flight(self) -> bool:
        """Whether a new request may share blocks another request computes in the same step: a model
        with a full-attention group only (a sliding group's hits need window state planned from the index)."""
        return self.full is not None and self.sliding is None

    def _full_only(self) -> FullAttentionManager:
        """The full group of a model that has no other (raises InvariantError otherwise)."""
        if self.full is None or self.sliding is not None:
            raise InvariantError("in-flight hits need a full-attention-only model")
        return self.full

    def plan_share(self, holder_id: str, num_blocks: int, num_tokens: int, root_key: bytes) -> KVShare | None:
        """Whether a new request, under namespace root `root_key`, can share the first `num_blocks` blocks
        of the holder's table, all full, and take a first chunk of `num_tokens` tokens after them; None
        when the pool has no room.

        The scheduler plans this for a request whose prompt shares those blocks with a request whose chunk
        in this step fills them (an in-flight hit, as vLLM caches a block when it schedules it): the runner
        writes every chunk's K/V before any attention reads it, so the new request's chunk reads them in
        the same forward. Asks the pool once.

        Raises:
            InvariantError: a model with a sliding group (`shares_in_flight` is False).
        """
        if not self._full_only().can_allocate(num_tokens):
            return None
        h = num_blocks * self.block_size
        plan = HitPlan(h=h, s=0, e=0, r=h, mode=ReplayMode.FULL, root_key=root_key, chain_keys=[])
        return KVShare(holder_id, num_blocks, num_tokens, plan)

    def share(self, request_id: str, token_ids: list[int], share: KVShare) -> Reservation:
        """First allocation of a new request, as `plan_share` decided: share the holder's blocks and
        reserve slots for `token_ids`, the first chunk's tokens from the end of the shared blocks.

        Raises:
            InvariantError: `token_ids` are not the chunk the share was planned for; nothing changes.
            ValueError, KeyError: as `FullAttentionManager.share_leading_blocks`; nothing changes.
        """
        require(len(token_ids) == share.num_tokens, f"{request_id}: a chunk other than the one planned")
        root = share.plan.root_key
        self._full_only().share_leading_blocks(share.holder_id, request_id, share.num_blocks, token_ids, root_key=root)
        return Reservation((share.plan.h,), 0)

    def plan_append(self, request_id: str, start_pos: int, num_tokens: int) -> KVGrowth | None:
        """Whether every group can take a chunk of `num_tokens` tokens at `start_pos` of the request's
        tables. Asks each pool once; None when one has no room."""
        groups = []
        for manager in self.managers:
            held = manager.num_tokens(request_id)
            skip = max(0, held - start_pos)
            if not manager.can_append(request_id, max(0, num_tokens - skip)):
                return None
            groups.append(GroupGrowth(manager, skip, max(held, start_pos)))
        return KVGrowth(request_id, start_pos, num_tokens, tuple(groups))

    def append(self, request_id: str, token_ids: list[int], growth: KVGrowth) -> Reservation:
        """Reserve slots for a chunk of a request that already has tables, as `plan_append` decided.

        Raises:
            InvariantError: a chunk or request other than the one planned; nothing changes.
        """
        planned = growth.request_id == request_id and len(token_ids) == growth.num_tokens
        require(planned, f"{request_id}: a chunk other than the one planned")
        num_copies = 0
        for group in growth.groups:
            num_copies += group.manager.append(request_id, token_ids[group.skip :])
        return Reservation(tuple(group.write_from for group in growth.groups), num_copies)

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
            manager.finish_chunk(request_id, cacheable=cacheable)

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
        """Raise InvariantError if a group's or the disk tier's invariants are broken, or a request has tables
        in some groups only."""
        for manager in self.managers:
            manager.check_invariants()
        tables = [set(m.tables()) for m in self.managers]
        require(all(t == tables[0] for t in tables), "a request has tables in some groups only")
        if self.tier is not None:
            self.tier.check_invariants()
