"""Continuous batching: which tokens of which requests the next forward computes, and what its results do.

Pure Python: no torch. Each step the scheduler fills a token budget, running requests first (decodes
and unfinished prefill chunks, oldest first), then waiting requests (oldest first). A waiting request
holds no blocks, except a fork child, which holds its parent's from the fork on; so when the oldest
cannot start, a fork child that can goes ahead of it, and when no request can start and none runs, the
waiting children give their parents' blocks back (newest first, until one can start): they then look
their contexts up in the prefix index like any new request. Without both, a child whose parent ended
could hold the blocks the requests ahead of it need for ever. A new request whose prompt shares blocks
that a running request's chunk fills in this step shares them at once (an in-flight hit: its chunk reads
them in the forward that computes them, and goes back to the queue if that chunk goes non-finite); if
they take more than this step, it waits for them. A request that cannot get blocks waits; when a
running request cannot grow, the newest running request is preempted: its blocks are released
and it goes back to the front of the queue, to be recomputed later (usually a prefix hit, since its
full blocks stay cached). After the forward, `postprocess` accounts for the computed chunks, appends
the sampled tokens and finishes the requests that stop; a request whose forward went non-finite fails
instead, and `stop_request` ends one unfinished (failed or aborted).

Invariant between steps: for every running or retained request, its block table holds exactly
`num_computed_tokens` tokens, and those are its context's first tokens.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Collection, Mapping

from engine.core.arith import common_prefix
from engine.core.config import EngineConfig
from engine.core.events import EventKind, EventLog
from engine.core.single_type_kv_cache_manager import BlockCopy
from engine.core.kv_coordinator import KVAdmission, KVCoordinator, KVGrowth, KVShare
from engine.core.kv_groups import HitPlan, max_hit_blocks
from engine.core.kv_tier import NO_TRANSFERS, TierLoad, TierTransfers
from engine.core.request import Request, RequestStatus, TokenLogprobs


@dataclass(slots=True)
class ReuseCounters:
    """Prompt tokens reused and computed, counted the way vLLM's metrics count them (in tokens).

    Three kinds of admission are kept apart, so that no number claims more reuse than happened:

        prefix lookup   a new request's prompt looked up in the prefix index (vLLM's
                        `prefix_cache_queries` / `prefix_cache_hits`); a hit counts only the tokens that
                        were not computed: the replay boundary r, not the hit position h (a sliding-window
                        hit replayed from r = 0 saved nothing); an in-flight hit, on blocks another request
                        computes in the same step, counts too (vLLM caches blocks when it schedules them)
        fork            a child's context shared from its parent's table (not an index lookup)
        re-admission    a preempted request looked up again; its reuse is its own recomputation, not a
                        prefix hit (vLLM #25780), so it is counted here and nowhere else
    """

    prefix_query_tokens: int = 0  # prompt tokens of new requests looked up in the prefix index
    prefix_hit_tokens: int = 0  # of which reused from the index and not computed (r per request)
    tier_hit_tokens: int = 0  # of which read from the disk tier (the rest came from the pool)
    replayed_tokens: int = 0  # hit tokens computed again to rebuild sliding-window state (h - r)
    fork_query_tokens: int = 0  # context tokens of fork children at their first admission
    fork_shared_tokens: int = 0  # of which shared from the parent and not computed
    preempted_query_tokens: int = 0  # context tokens of preempted requests looked up again on re-admission
    preempted_hit_tokens: int = 0  # of which found in the cache (their own blocks, mostly)

    def count_admission(self, request: Request, plan: HitPlan | None, start: int, *, first_time: bool) -> None:
        """Count one admission: `plan` is its hit plan (None for a fork child's first admission) and
        `start` the position its first chunk starts at."""
        if not first_time:
            self.preempted_query_tokens += request.num_tokens
            self.preempted_hit_tokens += start
        elif plan is None:
            self.fork_query_tokens += request.num_prompt_tokens
            self.fork_shared_tokens += start
        else:
            self.prefix_query_tokens += request.num_prompt_tokens
            self.prefix_hit_tokens += start
            self.tier_hit_tokens += max(0, start - (plan.h - plan.tier_tokens))  # the pool's hit ends at h - tier
            self.replayed_tokens += plan.replayed_tokens

    def tier_hit_lost(self, tokens: int) -> None:
        """A request's disk-tier hit of `tokens` tokens failed its checksum: they were computed after all."""
        self.prefix_hit_tokens -= min(tokens, self.tier_hit_tokens)
        self.tier_hit_tokens -= min(tokens, self.tier_hit_tokens)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one request that the next forward computes, at positions start_pos.. onwards."""

    request: Request
    token_ids: list[int]
    start_pos: int
    write_from: tuple[int, ...]  # per KV group: first position this chunk writes (see KVCoordinator)
    reads_from: str | None = None  # the request whose chunk in this step computes blocks this one reads

    @property
    def reaches_end(self) -> bool:
        """True when the chunk computes the context's last token, so its logits are sampled."""
        return self.start_pos + len(self.token_ids) == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class Admission:
    """A waiting request that can start now, with everything its start commits: decided once, when the
    scheduler asked whether it can start, and committed by `Scheduler._admit` as it stands."""

    request: Request
    start: int  # where its first chunk starts: the hit plan's replay boundary, or a fork child's shared end
    num_tokens: int  # the first chunk's length
    # new tables from a hit plan, or shared from a request computing them in this step (an in-flight hit),
    # or (a fork child) growth of the tables it shares with its parent
    kv: KVAdmission | KVShare | KVGrowth


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    copies: tuple[list[BlockCopy], ...]  # per KV group: copy-on-write copies to execute before the forward
    preempted: list[Request]
    changed: list[Request]  # every request this step changes: those with a chunk, then the preempted
    tier: TierTransfers = NO_TRANSFERS  # disk-tier stores, then loads, to execute before the copies and the forward


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCoordinator, log: EventLog, eos_token_ids: Collection[int]):
        self.kv = kv
        self._log = log
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.counters = ReuseCounters()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        self.kv.settle_tier()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            n = min(budget, request.num_tokens - start)
            growth = self._make_room(request, n, preempted)
            if growth is None:
                break  # it preempted itself: it was the newest, nothing runs after it
            tokens = request.tokens(start, start + n)
            reservation = self.kv.append(request.request_id, tokens, growth)
            request.reserved(reservation.num_copies)
            chunks.append(ScheduledChunk(request, tokens, start, reservation.write_from))
            budget -= n
            i += 1

        budget = self._admit_waiting(chunks, budget, preempted)
        while not chunks and not self.running and self._give_back_a_fork_share():
            budget = self._admit_waiting(chunks, budget, preempted)

        changed = [chunk.request for chunk in chunks] + preempted
        return SchedulerOutput(chunks, self.kv.take_copies(), preempted, changed, self.kv.take_tier_transfers())

    def _make_room(self, request: Request, num_tokens: int, preempted: list[Request]) -> KVGrowth | None:
        """Preempt the newest running requests until the request's next chunk fits. Returns the growth
        that fits, or None when the request had to preempt itself."""
        rid, start = request.request_id, request.num_computed_tokens
        while (growth := self.kv.plan_append(rid, start, num_tokens)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None
        return growth

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int, preempted: list[Request]) -> int:
        """Start waiting requests while the budget, the running set and the pool allow, adding their first
        chunks to `chunks`; returns the budget left. None starts in a step that preempted."""
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            admission = self._next_admissible(budget)
            if admission is None:
                break
            self.waiting.remove(admission.request)
            self.running.append(admission.request)
            chunks.append(self._admit(admission))
            budget -= admission.num_tokens
        return budget

    def _give_back_a_fork_share(self) -> bool:
        """Free the blocks of the newest waiting fork child that still holds its parent's; False if none does."""
        for request in reversed(self.waiting):
            if self.kv.has_table(request.request_id):
                shared = request.num_computed_tokens
                self.kv.free(request.request_id)
                request.fork_share_given_back()
                detail = {"num_computed_tokens": shared, "waiting": True}
                self._log.emit(EventKind.PREEMPT, detail, request_id=request.request_id, tokens=shared)
                self.num_preemptions += 1
                return True
        return False

    def _next_admissible(self, budget: int) -> Admission | None:
        """The waiting request to start next, with what its start commits: the oldest if it can start
        now, else the oldest fork child that can (see the module docstring), else None."""
        head = self._admission(self.waiting[0], budget)
        if head is not None:
            return head
        for request in itertools.islice(self.waiting, 1, None):
            if self.kv.has_table(request.request_id):
                child = self._admission(request, budget)
                if child is not None:
                    return child
        return None

    def _admission(self, request: Request, budget: int) -> Admission | None:
        """Whether a waiting request can start now, and if so what its start commits; None if not.

        A fork child grows the tables it shares with its parent from their end. Any other request is
        looked up in the prefix index (its chain keys are kept on it, so waiting hashes nothing twice)
        and starts at its hit plan's replay boundary, unless another request is computing its next block:
        then it shares that request's blocks now, or waits (`_in_flight_admission`). Its salt becomes a
        namespace root here, once (`KVCoordinator.roots`); the plan carries the root from here on.
        """
        rid = request.request_id
        if self.kv.has_table(rid):
            start = self.kv.num_tokens(rid)
            n = min(budget, request.num_tokens - start)
            growth = self.kv.plan_append(rid, start, n)
            return None if growth is None else Admission(request, start, n, growth)
        keys = request.lookup_keys(self.kv.roots.root_key(request.salt), self.kv.block_size)
        plan = self.kv.plan_hit(request.all_token_ids, keys)
        holder = self._computing_next_block(request, plan.r)
        if holder is not None:
            return self._in_flight_admission(request, holder, plan.root_key, budget)
        n = min(budget, request.num_tokens - plan.r)
        tables = self.kv.plan_admission(plan, n)
        return None if tables is None else Admission(request, plan.r, n, tables)

    def _admit(self, admission: Admission) -> ScheduledChunk:
        """Start a waiting request as `_admission` decided: reserve its first chunk's blocks."""
        request, start = admission.request, admission.start
        rid = request.request_id
        tokens = request.tokens(start, start + admission.num_tokens)
        plan: HitPlan | None = None
        reads_from = None
        if isinstance(admission.kv, KVAdmission):
            plan = admission.kv.plan
            reservation = self.kv.admit(rid, tokens, admission.kv)
        elif isinstance(admission.kv, KVShare):
            plan, reads_from = admission.kv.plan, admission.kv.holder_id
            reservation = self.kv.share(rid, tokens, admission.kv)
        else:
            reservation = self.kv.append(rid, tokens, admission.kv)
        first_time = request.first_scheduled_time is None
        request.admitted(start, plan, time.time())
        request.reserved(reservation.num_copies)
        self.counters.count_admission(request, plan, start, first_time=first_time)
        if first_time:
            detail = {
                "cached_tokens": request.cached_tokens,
                "disk_cached_tokens": request.disk_cached_tokens,
                "computed_tokens": request.num_prompt_tokens - start,
                "hit_source": request.hit_source.value,
            }
            if reads_from is not None:
                detail["in_flight_from"] = reads_from
            self._log.emit(EventKind.SCHEDULE, detail, request_id=rid, tokens=request.num_prompt_tokens)
        return ScheduledChunk(request, tokens, start, reservation.write_from, reads_from)

    def _computing_next_block(self, request: Request, hit_end: int) -> Request | None:
        """The running request, if any, still prefilling the block of this prompt that follows its hit."""
        bs = self.kv.block_size
        end = hit_end + bs
        if end > max_hit_blocks(request.num_tokens, bs) * bs:  # past the hit cap: no further block could be reused
            return None
        head = request.tokens(0, end)
        return next(
            (
                other
                for other in self.running
                if other.prefilling
                and other.salt == request.salt
                and other.num_computed_tokens < end
                and other.num_tokens >= end
                and other.tokens(0, end) == head
            ),
            None,
        )

    def _in_flight_admission(
        self, request: Request, holder: Request, root_key: bytes, budget: int
    ) -> Admission | None:
        """A new request (under namespace root `root_key`) whose next block `holder` is computing: share
        the holder's blocks now when its chunk in this step fills every full block the two prompts share;
        else None, to wait for them.

        Admitting it on its own would compute those blocks a second time (a burst of requests with a new
        system prompt would all prefill it together). Sharing them in the same step is what vLLM does (it
        caches a block when it schedules it): the new request's chunk reads them in the forward that
        computes them. Where they take more than this step (a prefix in several chunks), or the model has a
        sliding group, the request waits, and hits them in the prefix index once they are cached.
        """
        if not self.kv.shares_in_flight:
            return None
        bs = self.kv.block_size
        common = common_prefix(request.all_token_ids, holder.all_token_ids)
        num_blocks = min(common, max_hit_blocks(request.num_tokens, bs) * bs) // bs
        if self.kv.num_tokens(holder.request_id) < num_blocks * bs:
            return None
        n = min(budget, request.num_tokens - num_blocks * bs)
        share = self.kv.plan_share(holder.request_id, num_blocks, n, root_key)
        return None if share is None else Admission(request, num_blocks * bs, n, share)

    def _preempt(self, request: Request, *, after_failure_of: str | None = None) -> None:
        """Free a running request's blocks and put it back at the front of the queue. `after_failure_of`:
        the request whose failed chunk computed blocks this one read in the same step."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        detail: dict[str, object] = {"num_computed_tokens": request.num_computed_tokens}
        if after_failure_of is not None:
            detail["after_failure_of"] = after_failure_of
        self._log.emit(EventKind.PREEMPT, detail, request_id=request.request_id, tokens=request.num_computed_tokens)
        request.preempted()
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ after the forward
    def postprocess(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        failed: Mapping[str, str] | None = None,
        logprobs: Mapping[str, TokenLogprobs] | None = None,
        failed_loads: Collection[TierLoad] = (),
    ) -> list[Request]:
        """Account for the forward over `out`: computed chunks enter the cache, sampled tokens are
        appended, requests that stop finish, and requests whose forward went wrong fail. Returns the
        requests that ended (finished or failed), in chunk order.

        Args:
            out: this step's schedule.
            sampled: the token sampled for each request whose chunk reached its context's end.
            failed: why each request in it failed (request id -> reason), for chunks whose forward came
                out non-finite: such a chunk is not computed, its request ends FAILED and its blocks are
                freed, none of them cached. A chunk that read blocks a failed chunk computed (an in-flight
                hit) is not computed either: its request goes back to the queue, as if preempted.
            logprobs: the sampled token's logprobs, for the requests that asked for them.
            failed_loads: disk-tier loads whose bytes did not match their checksum: the entries leave the
                tier, and their requests (and those that read from them) go back to the queue, as if
                preempted, to compute those blocks (their chunks were neither sampled nor cached).
        """
        failed = failed or {}
        reload = {load.request_id for load in failed_loads}
        for load in failed_loads:
            if self.kv.tier is not None:
                self.kv.tier.discard(load)
        logprobs = logprobs or {}
        finished = []
        now = time.time()
        for chunk in out.chunks:
            request = chunk.request
            if request.request_id in failed:
                self.stop_request(request, RequestStatus.FAILED, failed[request.request_id])
                finished.append(request)
                continue
            if chunk.reads_from in failed:  # its in-flight hit's blocks were zeroed: recompute it later
                self._preempt(request, after_failure_of=chunk.reads_from)
                continue
            if request.request_id in reload or chunk.reads_from in reload:  # a torn disk-tier block
                self.counters.tier_hit_lost(request.tier_hit_lost())
                self._preempt(request, after_failure_of=chunk.reads_from or request.request_id)
                continue
            request.chunk_computed(len(chunk.token_ids))
            self.kv.finish_chunk(request.request_id, cacheable=request.cacheable)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_token(token, now, logprobs.get(request.request_id))
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
        return finished

    def _stop_reason(self, request: Request, token: int) -> str | None:
        if not request.sampling.ignore_eos and token in self.eos_token_ids:
            return "eos"
        if len(request.output_token_ids) >= request.sampling.max_new_tokens:
            return "length"
        return None

    def _finish(self, request: Request, reason: str, now: float) -> None:
        """Take a finished request out of the running set; free its blocks unless it is retained."""
        self.running.remove(request)
        rid = request.request_id
        keys = self.kv.prompt_keys(rid, request.prompt_token_ids)
        request.finished(reason, self.kv.block_ids(rid), now, prompt_keys=keys)
        self._end(request)

    def stop_request(self, request: Request, status: RequestStatus, reason: str) -> None:
        """End a waiting or running request unfinished (`status` FAILED or ABORTED); its blocks are freed.

        Raises:
            ValueError: a request that is neither waiting nor running, or a status that is not such an
                end; nothing changes.
        """
        rid = request.request_id
        if request in self.running:
            queue = self.running
        elif request in self.waiting:
            queue = self.waiting
        else:
            raise ValueError(f"request {rid!r} is {request.status.value}: neither waiting nor running")
        tables = self.kv.block_ids(rid) if self.kv.has_table(rid) else {}
        request.stopped(status, reason, tables, time.time())  # raises on a wrong status, before any change
        queue.remove(request)
        self._end(request)

    def _end(self, request: Request) -> None:
        """What every end shares, after the request's own transition: its blocks are freed unless it is
        retained, and a FINISH event records how it ended (its status and reason)."""
        rid = request.request_id
        if request.status is not RequestStatus.RETAINED and self.kv.has_table(rid):
            self.kv.free(rid)
        num_output = len(request.output_token_ids)
        detail = {"reason": request.finish_reason, "output_tokens": num_output, "status": request.status.value}
        self._log.emit(EventKind.FINISH, detail, request_id=rid, tokens=num_output)
