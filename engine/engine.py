"""The engine loop and its thread-safe Python API.

    engine = Engine(EngineConfig(model="tiny-llama", num_blocks=256))
    a = engine.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=8), retain=True)
    engine.run_until_idle()
    b = engine.fork(a, [5, 6])
    engine.run_until_idle()
    engine.get(b).output_token_ids

One step reads in three lines: schedule, run the model, post-process. Every public method takes one
lock, so commands from other threads (the console) land between steps and snapshots are consistent.
`start()` runs steps on a background thread whenever there is work; it never touches Streamlit.
Listeners get each step's events and the requests that changed, on the engine thread, after the step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.events import Event, EventKind, EventLog
from engine.kv_cache_manager import KVCacheManager
from engine.kv_coordinator import KVCoordinator
from engine.kv_groups import WindowPolicy
from engine.model_runner import ModelRunner, SeqChunk
from engine.models import LoadedModel, load_model
from engine.namespace import CacheNamespace
from engine.request import HitSource, Request, RequestStatus, SamplingParams
from engine.sampler import sample
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engine.verify import divergence
from engine.snapshot import BlockView, EngineSnapshot, GroupStats, PoolStats, RequestView

logger = logging.getLogger(__name__)

DEFAULT_NUM_BLOCKS = 1024
MAX_REQUEST_ID_LEN = 128
Listener = Callable[[list[Event], list[RequestView]], None]


class RequestRejected(ValueError):
    """The engine refused a request it can never serve (it is recorded with status "rejected")."""


@dataclass(frozen=True)
class ResetResult:
    dropped_blocks: int  # unreferenced cached blocks evicted
    kept_blocks: int  # cached blocks kept because running or retained requests hold them

    @property
    def ok(self) -> bool:
        """True when the prefix cache is now empty."""
        return self.kept_blocks == 0


def pool_size(config: EngineConfig, loaded: LoadedModel) -> int:
    """Blocks in the pool: `num_blocks`, or as many as `kv_memory_mb` holds, or the default."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_memory_mb is not None:
        num = config.kv_memory_mb * 2**20 // ModelRunner.bytes_per_block(loaded, config.block_size)
        if num < 1:
            raise ValueError(f"kv_memory_mb={config.kv_memory_mb} holds less than one block")
        return int(num)
    return DEFAULT_NUM_BLOCKS


class Engine:
    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            data_dir=config.resolved_data_dir,
            seed=config.seed,
            attention_override=config.attention_override,
        )
        num_blocks = pool_size(config, self.loaded)
        self.runner = ModelRunner(self.loaded, num_blocks, config.block_size)
        self.log = EventLog()
        window_policy = WindowPolicy(config.window_backtrack, config.allow_approximate_replay)
        self.namespace = CacheNamespace(
            model_id=self.loaded.model_id,
            weights_revision=self.loaded.weights_revision,
            dtype=config.dtype,
            block_size=config.block_size,
            attention_spec=self.loaded.attention_spec,
        )
        managers = [
            KVCacheManager(
                BlockPool(num_blocks, config.block_size, self.log, group=spec.name, chained=spec.window is None),
                self.namespace,
                self.log,
                window=spec.window,
                retain_tokens=None if spec.window is None else spec.window + config.window_backtrack,
            )
            for spec in self.runner.groups
        ]
        self.kv = KVCoordinator(self.runner.groups, managers, window_policy, self.log)
        self.scheduler = Scheduler(
            self.kv,
            self.log,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )
        self.vocab_size = int(self.loaded.model.config.vocab_size)
        self.max_model_len = int(self.loaded.max_position_embeddings)
        self._requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._replay_logits: dict[str, list[torch.Tensor]] = {}  # approximate replays under verification
        self._ids = itertools.count()
        self._step = 0
        self._listeners: list[Listener] = []
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: BaseException | None = None  # set when the background loop died
        self._retired: str | None = None  # why this engine takes no new requests (see `retire`)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def num_blocks(self) -> int:
        """Blocks per KV group pool."""
        return self.kv.managers[0].pool.num_blocks

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener` (added earlier); from the next event on."""
        with self._lock:
            self._listeners.remove(listener)

    # ------------------------------------------------------------------ commands
    def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        retain: bool = False,
        salt: str | None = None,
    ) -> str:
        """Queue a request. Returns its id.

        Raises:
            ValueError: bad input (empty or out-of-vocabulary tokens, a taken id, a context longer
                than the model's) or a retired engine; nothing is recorded.
            RequestRejected: the request can never fit in the pool; it is recorded as rejected.
        """
        sampling = sampling or SamplingParams()
        with self._lock:
            rid = self._claim_id(request_id)
            tokens = self._check_tokens(prompt_token_ids, "prompt")
            self._check_length(len(tokens), sampling)
            request = Request(rid, tokens, sampling, retain=retain, salt=salt, arrival_time=time.time())
            self._enqueue(request)
            return rid

    def fork(
        self,
        parent_id: str,
        suffix_token_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        retain: bool = False,
    ) -> str:
        """Queue a child whose context is the parent's tokens (prompt and output) plus `suffix_token_ids`.

        The child shares every block of the parent's table, its partial tail included; it computes only
        the parent's last sampled token (when its KV was never computed) and the suffix.

        Raises:
            ValueError: unknown parent, a parent that holds no KV (waiting, finished without retain,
                released), an empty or invalid suffix, or a retired engine; nothing changes.
        """
        sampling = sampling or SamplingParams()
        with self._lock:
            parent = self._requests.get(parent_id)
            if parent is None:
                raise ValueError(f"unknown parent request {parent_id!r}")
            if parent.status not in (RequestStatus.RUNNING, RequestStatus.RETAINED):
                raise ValueError(
                    f"cannot fork {parent_id!r}: it is {parent.status.value}; only running or retained requests "
                    "hold KV to share"
                )
            rid = self._claim_id(request_id)
            suffix = self._check_tokens(suffix_token_ids, "fork suffix")
            context = parent.all_token_ids + suffix
            self._check_length(len(context), sampling)
            child = Request(
                rid,
                context,
                sampling,
                parent_id=parent_id,
                retain=retain,
                salt=parent.salt,
                hit_source=HitSource.FORK,
                arrival_time=time.time(),
                cacheable=parent.cacheable,
            )
            if self._blocks_for(len(context), sampling) > self.num_blocks:
                self._enqueue(child)  # records the rejection and raises
            shared = self.kv.fork(parent_id, rid)
            child.num_computed_tokens = shared
            child.cached_tokens = shared
            child.replay_from = shared
            child.replay_mode = "fork"
            self._enqueue(child)
            return rid

    def release(self, request_id: str) -> None:
        """Release a retained request's blocks (or make a running retained request free them at the end).

        Raises:
            ValueError: unknown request, or one that holds nothing to release.
        """
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise ValueError(f"unknown request {request_id!r}")
            if request.status is RequestStatus.RETAINED:
                self.kv.free(request_id)
                request.status = RequestStatus.RELEASED
                self._publish([], [request])
            elif request.status in (RequestStatus.RUNNING, RequestStatus.WAITING) and request.retain:
                request.retain = False
            else:
                raise ValueError(f"request {request_id!r} is {request.status.value}: nothing to release")

    def reset_cache(self) -> ResetResult:
        """Evict every unreferenced cached block; says honestly whether the cache is now empty."""
        with self._lock:
            dropped, kept = self.kv.reset_prefix_cache()
            self._publish(self.log.take(), [])
            return ResetResult(dropped, kept)

    def retire(self, reason: str) -> list[RequestView]:
        """End every request that is not done and refuse new ones, for an engine being replaced (call
        `stop()` first).

        Waiting and running requests become aborted with `reason`, retained ones released; afterwards no
        request holds a block, and `submit` and `fork` raise `ValueError` naming `reason`. Listeners see
        the changes like any step's. Returns the requests changed.
        """
        with self._lock:
            self._retired = reason
            changed = []
            for request in self._requests.values():
                if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                    self.scheduler.stop_request(request, RequestStatus.ABORTED, reason)
                elif request.status is RequestStatus.RETAINED:
                    self.kv.free(request.request_id)
                    request.status = RequestStatus.RELEASED
                else:
                    continue
                self._generators.pop(request.request_id, None)
                self._replay_logits.pop(request.request_id, None)
                changed.append(request)
            self._publish(self.log.take(), changed)
            return [self._view(r) for r in changed]

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestView]:
        """Run one scheduling step and one forward. Returns the requests that finished in it."""
        with self._lock:
            self._step += 1
            self.log.step = self._step
            out = self.scheduler.schedule()
            sampled, failed = self._execute(out)
            finished = self._postprocess(out, sampled, failed)
            changed = {c.request.request_id: c.request for c in out.chunks}
            changed.update((r.request_id, r) for r in out.preempted)
            events = self.log.take()
            for event in events:
                if event.kind is EventKind.COW:
                    self._requests[event.request_id].cow_copies += 1
            self._publish(events, list(changed.values()))
            return [self._view(r) for r in finished]

    def _execute(self, out: SchedulerOutput) -> tuple[dict[str, int], set[str]]:
        """Copy-on-write copies, then one forward over every chunk.

        Returns:
            The sampled token of each request whose chunk reached its context's end, and the requests
            whose chunk came out non-finite (their K/V is already zeroed; see `_non_finite`).
        """
        if any(out.copies):
            self.runner.copy_blocks(out.copies)
        if not out.chunks:
            return {}, set()
        chunks = [
            SeqChunk(c.token_ids, c.start_pos, self.kv.slots(c.request.request_id, c.write_from)) for c in out.chunks
        ]
        logits = self.runner.execute(chunks)
        failed = self._non_finite(chunks, out.chunks, logits)
        ends = [i for i, c in enumerate(out.chunks) if c.reaches_end and c.request.request_id not in failed]
        if not ends:
            return {}, failed
        requests = [out.chunks[i].request for i in ends]
        if self.config.verify_replay:
            for i, request in zip(ends, requests):
                if request.replay_mode == "approximate":
                    self._replay_logits.setdefault(request.request_id, []).append(logits[i].cpu())
        tokens = sample(
            logits[ends], [r.sampling for r in requests], [self._generators.get(r.request_id) for r in requests]
        )
        return {r.request_id: t for r, t in zip(requests, tokens)}, failed

    def _non_finite(self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk], logits: torch.Tensor) -> set[str]:
        """The requests whose chunk's last-position logits hold a NaN or an infinity.

        Every chunk's last row is checked, prefill chunks too: causal attention carries a non-finite K/V
        to every later position, so the chunk that first computes one is caught before its blocks enter
        the prefix index. Each such chunk's K/V is zeroed at once (`ModelRunner.clear_slots`), so what
        its request computed never reaches another request through a reused block.
        """
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        failed = set()
        for chunk, scheduled_chunk, ok in zip(chunks, scheduled, finite):
            if not ok:
                self.runner.clear_slots(chunk)
                failed.add(scheduled_chunk.request.request_id)
        return failed

    def _postprocess(self, out: SchedulerOutput, sampled: dict[str, int], failed: set[str]) -> list[Request]:
        """Account for every computed chunk; finish the requests that stop; fail those in `failed`."""
        finished = []
        now = time.time()
        for chunk in out.chunks:
            request = chunk.request
            if request.request_id in failed:
                reason = f"non-finite logits (NaN or inf) at position {chunk.start_pos + len(chunk.token_ids) - 1}"
                logger.warning("request %s failed: %s", request.request_id, reason)
                self.scheduler.stop_request(request, RequestStatus.FAILED, reason)
                self._generators.pop(request.request_id, None)
                self._replay_logits.pop(request.request_id, None)
                finished.append(request)
                continue
            self.scheduler.finish_chunk(chunk)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.output_token_ids.append(token)
            request.prefilling = False
            if request.first_token_time is None:
                request.first_token_time = now
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.scheduler.finish_request(request, reason)
                self._generators.pop(request.request_id, None)
                self._verify_replay(request)
                finished.append(request)
        return finished

    def _verify_replay(self, request: Request) -> None:
        """For an approximate replay under verification: recompute from scratch, record the divergence."""
        recorded = self._replay_logits.pop(request.request_id, None)
        if not recorded:
            return
        tokens = request.all_token_ids
        n = len(recorded)
        reference = self.runner.reference_logits(tokens[:-1])[-n:].cpu()
        request.replay_divergence = divergence(torch.stack(recorded[-n:]), reference).as_dict()
        self.log.emit(
            EventKind.REPLAY,
            request_id=request.request_id,
            tokens=request.replayed_tokens,
            detail={"mode": request.replay_mode, "verified": True, **request.replay_divergence},
        )

    def _stop_reason(self, request: Request, token: int) -> str | None:
        if not request.sampling.ignore_eos and token in self.loaded.eos_token_ids:
            return "eos"
        if len(request.output_token_ids) >= request.sampling.max_new_tokens:
            return "length"
        return None

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[RequestView]:
        """Step until nothing waits or runs. Returns the requests that finished, in order."""
        finished: list[RequestView] = []
        for _ in range(max_steps):
            if not self.has_work():
                return finished
            finished += self.step()
        raise RuntimeError(f"still busy after {max_steps} steps")

    # ------------------------------------------------------------------ background thread
    def start(self) -> None:
        """Run steps on a daemon thread whenever there is work."""
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="prefix-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._work:
            self._stopping = True
            self._work.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        while True:
            with self._work:
                while not self._stopping and not self.scheduler.has_work:
                    self._work.wait(timeout=1.0)
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # the loop must not die silently: record and stop stepping
                logger.exception("engine step failed; the background loop stops")
                self.failure = exc
                return

    # ------------------------------------------------------------------ reading
    def get(self, request_id: str) -> RequestView:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise KeyError(f"unknown request {request_id!r}")
            return self._view(request)

    def requests(self) -> list[RequestView]:
        with self._lock:
            return [self._view(r) for r in self._requests.values()]

    def stats(self) -> PoolStats:
        """Counters summed over the KV groups, with each group's own numbers in `groups`."""
        with self._lock:
            groups = tuple(
                GroupStats(
                    name=m.pool.group,
                    window=m.window,
                    num_blocks=m.pool.num_blocks,
                    free_blocks=m.pool.num_free,
                    cached_blocks=m.pool.num_cached,
                    evictable_blocks=m.pool.num_evictable,
                    used_blocks=m.pool.num_blocks - m.pool.num_allocatable,
                    logical_blocks=m.num_logical_blocks(),
                    evictions=m.pool.num_evictions,
                    cow_copies=m.num_cow_copies,
                    window_released_blocks=m.num_window_released,
                )
                for m in self.kv.managers
            )
            statuses = [r.status for r in self._requests.values()]

            def total(field: str) -> int:
                return sum(getattr(g, field) for g in groups)

            return PoolStats(
                num_blocks=total("num_blocks"),
                block_size=self.config.block_size,
                free_blocks=total("free_blocks"),
                cached_blocks=total("cached_blocks"),
                evictable_blocks=total("evictable_blocks"),
                used_blocks=total("used_blocks"),
                logical_blocks=total("logical_blocks"),
                evictions=total("evictions"),
                cow_copies=total("cow_copies"),
                preemptions=self.scheduler.num_preemptions,
                prefix_query_tokens=self.scheduler.prefix_query_tokens,
                prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
                steps=self._step,
                num_waiting=len(self.scheduler.waiting),
                num_running=len(self.scheduler.running),
                num_retained=statuses.count(RequestStatus.RETAINED),
                groups=groups,
            )

    def snapshot(self) -> EngineSnapshot:
        """Every block of every KV group, every request and the counters, all from the same moment."""
        with self._lock:
            blocks = tuple(
                BlockView(
                    block_id=b.block_id,
                    group=manager.pool.group,
                    state=manager.pool.state_of(b),
                    ref_count=b.ref_count,
                    num_tokens=len(b.token_ids),
                    token_ids=tuple(b.token_ids),
                    key=b.key.hex() if b.key else None,
                    parent_key=b.parent_key.hex() if b.parent_key else None,
                    start_pos=b.start_pos,
                    created_at=b.created_at,
                    last_used=b.last_used,
                    hit_count=b.hit_count,
                    holders=tuple(holders.get(b.block_id, ())),
                )
                for manager in self.kv.managers
                for holders in (manager.holders(),)
                for b in manager.pool.blocks
            )
            return EngineSnapshot(time.time(), self.stats(), blocks, tuple(self._view(r) for r in self._requests.values()))

    def check_invariants(self) -> None:
        with self._lock:
            self.kv.check_invariants()
            for request in self._requests.values():
                holds = request.status in (RequestStatus.RUNNING, RequestStatus.RETAINED) or (
                    request.status is RequestStatus.WAITING and self.kv.has_table(request.request_id)
                )
                assert holds == self.kv.has_table(request.request_id), f"{request.request_id}: table mismatch"
                if holds:
                    assert self.kv.num_tokens(request.request_id) == request.num_computed_tokens

    # ------------------------------------------------------------------ helpers
    def _view(self, request: Request) -> RequestView:
        tables = self.kv.block_ids(request.request_id) if self.kv.has_table(request.request_id) else None
        return RequestView.of(request, tables or request.final_block_tables)

    def _publish(self, events: list[Event], changed: list[Request]) -> None:
        if not self._listeners:
            return
        views = [self._view(r) for r in changed]
        for listener in self._listeners:
            listener(events, views)

    def _claim_id(self, request_id: str | None) -> str:
        if self._retired is not None:
            raise ValueError(f"this engine takes no new requests: {self._retired}; reload the page for the new one")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
            raise ValueError(f"request ids are non-empty strings of at most {MAX_REQUEST_ID_LEN} characters")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already taken")
        return request_id

    def _check_tokens(self, token_ids: list[int], what: str) -> list[int]:
        tokens = list(token_ids)
        if not tokens:
            raise ValueError(f"the {what} is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in tokens):
            raise ValueError(f"the {what} has token ids outside [0, {self.vocab_size})")
        return tokens

    def _check_length(self, num_context: int, sampling: SamplingParams) -> None:
        total = num_context + sampling.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"context of {num_context} tokens + {sampling.max_new_tokens} new tokens exceeds the model's "
                f"maximum of {self.max_model_len} positions"
            )

    def _blocks_for(self, num_context: int, sampling: SamplingParams) -> int:
        return -(-(num_context + sampling.max_new_tokens) // self.config.block_size)

    def _enqueue(self, request: Request) -> None:
        """Record and queue a validated request, or record it as rejected when it can never fit."""
        self._requests[request.request_id] = request
        needed = self._blocks_for(request.num_prompt_tokens, request.sampling)
        if needed > self.num_blocks:
            request.status = RequestStatus.REJECTED
            request.finish_reason = "too large for the pool"
            reason = f"needs {needed} blocks for its context and new tokens; the whole pool has {self.num_blocks}"
            self.log.emit(
                EventKind.REJECT,
                request_id=request.request_id,
                tokens=request.num_prompt_tokens,
                detail={"reason": reason},
            )
            self._publish(self.log.take(), [request])
            raise RequestRejected(f"request {request.request_id!r} rejected: {reason}")
        if request.sampling.temperature > 0:
            seed = request.sampling.seed if request.sampling.seed is not None else self.config.seed
            self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        self.scheduler.add(request)
        self.log.emit(
            EventKind.SUBMIT,
            request_id=request.request_id,
            tokens=request.num_prompt_tokens,
            detail={"parent_id": request.parent_id},
        )
        self._publish(self.log.take(), [request])
        self._work.notify_all()
