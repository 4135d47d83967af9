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
from engine.kv_cache_manager import BlockCopy, KVCacheManager
from engine.request import HitSource, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one request that the next forward computes, at positions start_pos.. onwards."""

    request: Request
    token_ids: list[int]
    start_pos: int

    @property
    def reaches_end(self) -> bool:
        """True when the chunk computes the context's last token, so its logits are sampled."""
        return self.start_pos + len(self.token_ids) == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    copies: list[BlockCopy]  # copy-on-write copies to execute before the forward
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(self, manager: KVCacheManager, log: EventLog, *, max_num_batched_tokens: int, max_num_seqs: int):
        self.manager = manager
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
            if not self._grow(request, tokens, preempted):
                break  # it preempted itself: it was the newest, nothing runs after it
            chunks.append(ScheduledChunk(request, tokens, request.num_computed_tokens))
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

        return SchedulerOutput(chunks, self.manager.take_copies(), preempted)

    def _grow(self, request: Request, tokens: list[int], preempted: list[Request]) -> bool:
        """Reserve slots for a running request, preempting the newest running requests as needed.

        Returns False when the request had to preempt itself.
        """
        while not self.manager.allocate_slots(request.request_id, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int) -> ScheduledChunk | None:
        """Reserve blocks for a waiting request's first chunk, or return None (nothing changed)."""
        manager = self.manager
        rid = request.request_id
        hits = []
        if manager.has_table(rid):  # a fork child: its table was shared at fork time
            computed = manager.num_tokens(rid)
        else:
            hits = manager.find_prefix_hit(request.all_token_ids, request.salt)
            computed = len(hits) * manager.block_size
        n = min(budget, request.num_tokens - computed)
        tokens = request.all_token_ids[computed : computed + n]
        if not manager.allocate_slots(rid, tokens, hits=hits, salt=request.salt):
            return None
        first_time = request.first_scheduled_time is None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = computed
        if first_time:
            request.first_scheduled_time = time.time()
            if request.hit_source is not HitSource.FORK:
                request.cached_tokens = computed
                request.hit_source = HitSource.PREFIX if computed else HitSource.NONE
            self.prefix_query_tokens += request.num_prompt_tokens
            self.prefix_hit_tokens += request.cached_tokens
            self._log.emit(
                EventKind.SCHEDULE,
                request_id=rid,
                tokens=request.num_prompt_tokens,
                cached_tokens=request.cached_tokens,
                computed_tokens=request.num_prompt_tokens - request.cached_tokens,
                hit_source=request.hit_source.value,
            )
        return ScheduledChunk(request, tokens, computed)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.manager.free(request.request_id)
        self._log.emit(
            EventKind.PREEMPT,
            request_id=request.request_id,
            tokens=request.num_computed_tokens,
            num_computed_tokens=request.num_computed_tokens,
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
        self.manager.cache_full_blocks(request.request_id)

    def finish_request(self, request: Request, reason: str) -> None:
        """Take a finished request out of the running set; free its blocks unless it is retained."""
        self.running.remove(request)
        request.finish_reason = reason
        request.finish_time = time.time()
        request.final_block_table = self.manager.block_ids(request.request_id)
        if request.retain:
            request.status = RequestStatus.RETAINED
        else:
            request.status = RequestStatus.FINISHED
            self.manager.free(request.request_id)
        self._log.emit(
            EventKind.FINISH,
            request_id=request.request_id,
            tokens=len(request.output_token_ids),
            reason=reason,
            output_tokens=len(request.output_token_ids),
        )
