"""Continuous batching: which tokens of which requests the next forward computes.

Pure Python: no torch. Each step the scheduler fills a token budget, running requests first (decodes
and unfinished prefill chunks, oldest first), then waiting requests (oldest first). A request that
cannot get blocks waits; when a running request cannot grow, the newest running request is preempted:
its blocks are released and it goes back to the front of the queue, to be recomputed later (usually
a prefix hit, since its full blocks stay cached).

Invariant between steps: for every running or retained request, its block table holds exactly
`num_computed_tokens` tokens, and those are its context's first tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.events import EventKind, EventLog
from engine.kv_cache_manager import BlockCopy
from engine.kv_coordinator import KVCoordinator
from engine.request import HitSource, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one request that the next forward computes, at positions start_pos.. onwards."""

    request: Request
    token_ids: list[int]
    start_pos: int
    write_from: tuple[int, ...]  # per KV group: first position this chunk writes (see KVCoordinator)

    @property
    def reaches_end(self) -> bool:
        """True when the chunk computes the context's last token, so its logits are sampled."""
        return self.start_pos + len(self.token_ids) == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    copies: tuple[list[BlockCopy], ...]  # per KV group: copy-on-write copies to execute before the forward
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCoordinator, log: EventLog, *, max_num_batched_tokens: int, max_num_seqs: int):
        self.kv = kv
        self._log = log
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up at first admission
        self.prefix_hit_tokens = 0  # of which found in the cache (prefix index or fork)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove_waiting(self, request: Request) -> None:
        self.waiting.remove(request)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(budget, request.num_tokens - request.num_computed_tokens)
            tokens = request.all_token_ids[request.num_computed_tokens : request.num_computed_tokens + n]
            write_from = self._grow(request, tokens, preempted)
            if write_from is None:
                break  # it preempted itself: it was the newest, nothing runs after it
            chunks.append(ScheduledChunk(request, tokens, request.num_computed_tokens, write_from))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            chunk = self._admit(request, budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            chunks.append(chunk)
            budget -= len(chunk.token_ids)

        return SchedulerOutput(chunks, self.kv.take_copies(), preempted)

    def _grow(self, request: Request, tokens: list[int], preempted: list[Request]) -> tuple[int, ...] | None:
        """Reserve slots for a running request, preempting the newest running requests as needed.

        Returns the chunk's per-group write positions, or None when the request had to preempt itself.
        """
        while (write_from := self.kv.allocate(request.request_id, request.num_computed_tokens, tokens)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None
        return write_from

    def _admit(self, request: Request, budget: int) -> ScheduledChunk | None:
        """Reserve blocks for a waiting request's first chunk, or return None (nothing changed)."""
        kv = self.kv
        rid = request.request_id
        if kv.has_table(rid):  # a fork child: its tables were shared at fork time
            start = kv.num_tokens(rid)
            tokens = request.all_token_ids[start : start + min(budget, request.num_tokens - start)]
            write_from = kv.allocate(rid, start, tokens)
            plan = None
        else:
            plan = kv.plan_hit(request.all_token_ids, request.salt)
            if self._computed_by_another(request, plan.r):
                return None  # wait: next step this request hits the blocks another one is computing now
            start = plan.r
            tokens = request.all_token_ids[start : start + min(budget, request.num_tokens - start)]
            write_from = kv.admit(rid, tokens, plan, request.salt)
        if write_from is None:
            return None
        first_time = request.first_scheduled_time is None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = start
        if first_time:
            request.first_scheduled_time = time.time()
            if plan is not None:
                request.cached_tokens = plan.h
                request.hit_source = HitSource.PREFIX if plan.h else HitSource.NONE
                request.window_start, request.window_end = plan.s, plan.e
                request.replay_from, request.replay_mode = plan.r, plan.mode
                request.replayed_tokens = plan.replayed_tokens
            if plan is not None:  # every (re)admission decides afresh whether its state is exact
                request.cacheable = plan.mode != "approximate"
            self.prefix_query_tokens += request.num_prompt_tokens
            self.prefix_hit_tokens += request.cached_tokens
            self._log.emit(
                EventKind.SCHEDULE,
                request_id=rid,
                tokens=request.num_prompt_tokens,
                detail={
                    "cached_tokens": request.cached_tokens,
                    "computed_tokens": request.num_prompt_tokens - start,
                    "hit_source": request.hit_source.value,
                },
            )
        return ScheduledChunk(request, tokens, start, write_from)

    def _computed_by_another(self, request: Request, hit_end: int) -> bool:
        """True when a running request is still prefilling the block of this prompt that follows its hit.

        Admitting now would compute that block, and usually the rest of a shared prefix, a second time
        (a burst of requests with a new system prompt all prefill it together); once the other request's
        forward caches it, this request hits it instead.
        """
        bs = self.kv.block_size
        end = hit_end + bs
        tokens = request.all_token_ids
        if end > (len(tokens) - 1) // bs * bs:  # past the hit cap: no further block could be reused
            return False
        head = tokens[:end]
        return any(
            other.prefilling
            and other.salt == request.salt
            and other.num_computed_tokens < end
            and other.all_token_ids[:end] == head
            for other in self.running
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        self._log.emit(
            EventKind.PREEMPT,
            request_id=request.request_id,
            tokens=request.num_computed_tokens,
            detail={"num_computed_tokens": request.num_computed_tokens},
        )
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.preemptions += 1
        request.prefilling = True
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ after the forward
    def finish_chunk(self, chunk: ScheduledChunk) -> None:
        """Account for a computed chunk: its KV is now in the blocks; full blocks enter the index."""
        request = chunk.request
        request.num_computed_tokens += len(chunk.token_ids)
        if request.prefilling:
            request.computed_tokens += len(chunk.token_ids)
        self.kv.finish_chunk(request.request_id, cacheable=request.cacheable)

    def finish_request(self, request: Request, reason: str) -> None:
        """Take a finished request out of the running set; free its blocks unless it is retained."""
        self.running.remove(request)
        self._end(request, RequestStatus.RETAINED if request.retain else RequestStatus.FINISHED, reason)

    def stop_request(self, request: Request, status: RequestStatus, reason: str) -> None:
        """End a waiting or running request unfinished (`status` FAILED or ABORTED); its blocks are freed.

        Raises:
            ValueError: a request that is neither waiting nor running, or a status that is not an end.
        """
        if status not in (RequestStatus.FAILED, RequestStatus.ABORTED):
            raise ValueError(f"a stopped request ends failed or aborted, not {status.value}")
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}: neither waiting nor running")
        self._end(request, status, reason)

    def _end(self, request: Request, status: RequestStatus, reason: str) -> None:
        """Record the end (status, reason, time, final tables) and free the blocks unless retained."""
        request.status = status
        request.finish_reason = reason
        request.finish_time = time.time()
        if self.kv.has_table(request.request_id):
            request.final_block_tables = self.kv.block_ids(request.request_id)
            if status is not RequestStatus.RETAINED:
                self.kv.free(request.request_id)
        self._log.emit(
            EventKind.FINISH,
            request_id=request.request_id,
            tokens=len(request.output_token_ids),
            detail={"reason": reason, "output_tokens": len(request.output_token_ids), "status": status.value},
        )
