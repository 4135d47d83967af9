"""The engine loop and its thread-safe Python API.

    engine = Engine(EngineConfig(model="tiny-llama", num_blocks=256))
    a = engine.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=8), retain=True)
    engine.run_until_idle()
    b = engine.fork(a, [5, 6])
    engine.run_until_idle()
    engine.get(b).output_token_ids

One step reads in three lines: schedule, run the model, post-process (see `step`). Every public
method takes one lock, so commands from other threads (the console) land between steps and snapshots
are consistent.
`start()` runs steps on a background thread whenever there is work; it never touches Streamlit.
Listeners get each step's events and the requests that changed, on the engine thread, after the step.

A request's input passes the admission step (engine/core/admission.py) before anything is recorded.
Requests leave the engine when they end (engine/core/request_table.py keeps the last RECENT_ENDED ended
ones' final views; the history database keeps every request). So nothing in the engine's memory or in
its per-step work grows with the number of requests it ever served: per-request state (the scheduler's
queues, the KV block tables, the seeded generators, the replay verifier's logits) is held for live and
retained requests only. (One thing grows with distinct salts, not requests: each KV group's pool keeps
the namespace root of every salt it has seen.)
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch

from engine.core.admission import RequestInput, RequestRejected, admit, never_fits
from engine.core.config import EngineConfig
from engine.core.events import Event, EventKind
from engine.core.request import HitSource, Request, RequestStatus, SamplingParams, can_release
from engine.core.request_invariants import check_request_state
from engine.core.request_table import RequestTable
from engine.core.scheduler import SchedulerOutput
from engine.core.snapshot import EngineSnapshot, PoolStats, RequestView, ResetResult, block_views, pool_stats
from engine.core.tier_view import PromotionMarks, tier_view
from engine.engine_parts import build_parts
from engine.runner.model_loading import LoadedModel, load_model
from engine.step_thread import StepThread
from engine.warm_up import WARM_UP_TOKENS, warm_up


Listener = Callable[[list[Event], list[RequestView]], None]


class Engine:
    def __init__(
        self, config: EngineConfig, *, loaded: LoadedModel | None = None, first_request_number: int = 0
    ) -> None:
        """`first_request_number`: N of the first generated id "req-N" (past the ids already in a shared history)."""
        self._table = RequestTable(first_request_number)  # live, retained and recently ended requests
        self.config = config
        self.loaded = loaded or load_model(config)
        parts = build_parts(config, self.loaded)  # engine/engine_parts.py
        self.runner, self.log, self.namespace = parts.runner, parts.log, parts.namespace
        self.kv, self.scheduler = parts.core.kv, parts.core.scheduler
        self._verifier, self._forward, self.thread_governor = parts.verifier, parts.forward, parts.thread_governor
        self.limits = parts.limits  # what admission holds requests to
        self.vocab_size, self.max_model_len = self.limits
        self._generators: dict[str, torch.Generator] = {}  # seeded sampling of running requests
        self._listeners: list[Listener] = []
        self._promotions = PromotionMarks.of(self.kv)  # pool blocks the disk tier filled; None without a tier
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._thread: StepThread | None = None  # None: not started, or stopped
        self.failure: BaseException | None = None  # set when the background loop died
        self._retired: str | None = None  # why this engine takes no new requests (see `retire`)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def next_request_number(self) -> int:
        """The N of the next generated id "req-N" (a console raises it past a shared history's ids)."""
        return self._table.next_request_number

    @next_request_number.setter
    def next_request_number(self, number: int) -> None:
        self._table.next_request_number = number

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
            AdmissionError: input outside a bound (engine/core/admission.py: empty or out-of-vocabulary
                tokens, a logit bias naming tokens outside the vocabulary, a malformed id, a context
                longer than the model's, a salt over MAX_SALT_LEN characters); nothing is recorded.
            ValueError: a taken id or a retired engine; nothing is recorded.
            RequestRejected: the request can never fit in the pool; it is recorded as rejected.
        """
        sampling = sampling or SamplingParams()
        context = admit(RequestInput(prompt_token_ids, sampling, salt), self.limits)
        with self._lock:
            rid = self._claim_id(request_id)
            request = Request(rid, tuple(context), sampling, retain=retain, salt=salt, arrival_time=time.time())
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
            AdmissionError: an empty or invalid suffix (engine/core/admission.py); nothing changes.
            ValueError: unknown parent, a parent that holds no KV (waiting, finished without retain,
                released), or a retired engine; nothing changes.
            RequestRejected: the child can never fit in the pool; it is recorded as rejected.
        """
        ids = None if request_id is None else [request_id]
        return self.fork_many(parent_id, [suffix_token_ids], sampling, request_ids=ids, retain=retain)[0]

    def fork_many(
        self,
        parent_id: str,
        suffixes: list[list[int]],
        sampling: SamplingParams | None = None,
        *,
        request_ids: list[str] | None = None,
        retain: bool = False,
    ) -> list[str]:
        """Queue one child per suffix (as `fork` does), all within one hold of the engine lock.

        No step runs between the children, so they all share the parent's blocks before any of them
        writes: a shared partial tail reaches reference count 1 + len(suffixes), and each child's
        copy-on-write comes in a later step. Every child is checked before any is created.

        Args:
            parent_id: a running or retained request.
            suffixes: one child's suffix tokens each.
            sampling: how every child samples (default `SamplingParams()`).
            request_ids: the children's ids, one per suffix; None lets the engine assign them.
            retain: whether the children keep their blocks after finishing.

        Returns:
            The children's ids, in the order of `suffixes`.

        Raises:
            ValueError: as `fork`, for any child, or `request_ids` that do not pair up with the suffixes
                or repeat; nothing changes.
            RequestRejected: a child can never fit in the pool; it is recorded as rejected and no child
                is created.
        """
        sampling = sampling or SamplingParams()
        if request_ids is not None and len(request_ids) != len(suffixes):
            raise ValueError(f"{len(request_ids)} request ids for {len(suffixes)} suffixes")
        if not suffixes:
            raise ValueError("give at least one fork suffix")
        with self._lock:
            parent = self._table.fork_base(parent_id)
            children: list[Request] = []
            inherited = parent.all_token_ids
            for i, suffix_token_ids in enumerate(suffixes):
                given = RequestInput(suffix_token_ids, sampling, parent.salt)
                context = admit(given, self.limits, prefix=inherited, what="fork suffix")
                wanted = None if request_ids is None else request_ids[i]
                rid = self._claim_id(wanted, taken={c.request_id for c in children})
                child = Request(rid, tuple(context), sampling, parent_id=parent_id, retain=retain, salt=parent.salt,
                                hit_source=HitSource.FORK, arrival_time=time.time(),
                                cacheable=parent.cacheable)  # fmt: skip
                children.append(child)
            for child in children:
                if self._never_fits(child) is not None:
                    self._enqueue(child)  # records the rejection and raises
            for child in children:
                child.seeded_by_fork(self.kv.fork(parent_id, child.request_id), self.kv.ready_mode)
                self._enqueue(child)
            return [child.request_id for child in children]

    def release(self, request_id: str) -> None:
        """Release a retained request's blocks (or make a running retained request free them at the end).

        Raises:
            ValueError: unknown request, or one that holds nothing to release.
        """
        with self._lock:
            request = self._table.live.get(request_id)
            status = self._table.status_of(request_id)
            if status is None:
                raise ValueError(f"unknown request {request_id!r}")
            if request is None or not can_release(request.status, request.retain):  # RequestView.releasable's rule
                raise ValueError(f"request {request_id!r} is {status.value}: nothing to release")
            if request.status is RequestStatus.RETAINED:
                self.kv.free(request_id)
                request.released()
                self._table.settle(request, self._view)
                self._publish(self.log.take(), [request])  # its RELEASE events leave now, not with the next step
            else:
                request.release_when_finished()

    def abort(self, request_id: str, reason: str) -> bool:
        """End a waiting or running request unfinished: it becomes aborted, `reason` its finish reason, and
        its blocks are freed (the full blocks it cached stay in the prefix index). The API calls it for a
        client that went away and for a stop sequence, which the engine does not know.

        Returns:
            True when it was aborted; False when it had already ended (nothing changes).

        Raises:
            ValueError: unknown request.
        """
        with self._lock:
            request = self._table.live.get(request_id)
            if request is None:
                if request_id in self._table.ended:
                    return False
                raise ValueError(f"unknown request {request_id!r}")
            if request.status not in (RequestStatus.WAITING, RequestStatus.RUNNING):
                return False
            self.scheduler.stop_request(request, RequestStatus.ABORTED, reason)
            self._let_go(request)
            self._publish(self.log.take(), [request])
            return True

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
            for request in list(self._table.live.values()):  # each one leaves as it ends
                if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                    self.scheduler.stop_request(request, RequestStatus.ABORTED, reason)
                elif request.status is RequestStatus.RETAINED:
                    self.kv.free(request.request_id)
                    request.released()
                else:
                    continue
                self._let_go(request)
                changed.append(request)
            self._publish(self.log.take(), changed)
            return [self._view(r) for r in changed]

    def warm_up(self, num_tokens: int = WARM_UP_TOKENS) -> None:
        """Pay a first forward's one-time costs on throwaway tokens (engine/warm_up.py): nothing changes.

        Raises:
            RuntimeError: requests are queued or hold blocks (warm up right after construction).
        """
        with self._lock:
            if self.scheduler.has_work or any(m.pool.num_free < m.pool.num_blocks for m in self.kv.managers):
                raise RuntimeError("warm up an engine before it serves requests")
            warm_up(self.runner, self.num_blocks, self.config.block_size, self.limits, num_tokens)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestView]:
        """Run one scheduling step and one forward. Returns the requests that ended in it (finished or failed)."""
        with self._lock:
            self.log.step += 1
            out = self.scheduler.schedule()
            with self.thread_governor.step() if self.thread_governor is not None else nullcontext():
                done = self._forward.run(out, self._generators)
            finished = self.scheduler.postprocess(out, done.sampled, done.failed, done.logprobs, done.failed_loads)
            self._end_step(out, finished)
            return [self._view(r) for r in finished]

    def _end_step(self, out: SchedulerOutput, finished: list[Request]) -> None:
        """Let go of what ended requests held here (and verify their replays), then tell listeners."""
        for request in finished:
            self._let_go(request)
        self._publish(self.log.take(), out.changed)

    def _let_go(self, request: Request) -> None:
        """Drop what the engine kept for a request that ended: its generator and its captured replay
        logits (verified first when it finished; see `ReplayVerifier.verify`); then it leaves the table
        (`RequestTable.settle`)."""
        self._generators.pop(request.request_id, None)
        if self._verifier is not None:
            self._verifier.verify(request)
        self._table.settle(request, self._view)

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
        """Run steps on a daemon thread whenever there is work (engine/step_thread.py)."""
        with self._lock:
            if self._thread is None:
                self._thread = StepThread(self._work, self.step, self.has_work, self._failed)

    def stop(self) -> None:
        """Stop the daemon thread after its current step (and wait for it); the pool's cached blocks go to disk."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()
        with self._lock:
            self._forward.write_back()
            self._publish(self.log.take(), [])  # the write-back's DEMOTE events reach the history and the feed

    def close(self) -> None:
        """`stop()`, then close the disk tier's files and give up its lock, so that a replacing engine may open
        them (a console restarting its engine; an engine process exiting). The engine is done: a step that
        would store or load a block raises."""
        self.stop()
        with self._lock:
            self._forward.close_tier()

    def _failed(self, exc: BaseException) -> None:
        self.failure = exc

    # ------------------------------------------------------------------ reading
    def get(self, request_id: str) -> RequestView:
        """A live or retained request as of now, or a recently ended one as it ended.

        Raises:
            KeyError: an id the engine does not know, or one that ended more than RECENT_ENDED requests ago
                (the history database has it).
        """
        with self._lock:
            return self._table.get(request_id, self._view)

    def requests(self) -> list[RequestView]:
        """The live and retained requests as of now and the last RECENT_ENDED ended ones as they ended,
        by arrival, oldest first (older requests: the history database)."""
        with self._lock:
            return self._table.views(self._view)

    def forward_threads(self) -> int:
        """Threads the forward runs on now: the thread governor's count, or torch's where none governs."""
        return self.thread_governor.threads if self.thread_governor is not None else torch.get_num_threads()

    def forward_time_at_threads(self) -> dict[int, float]:
        """Seconds the forward stepped at each thread count (empty where no governor governs)."""
        return self.thread_governor.time_at_threads() if self.thread_governor is not None else {}

    def stats(self) -> PoolStats:
        """Counters summed over the KV groups, with each group's own numbers in `groups`."""
        with self._lock:
            return pool_stats(self.kv, self.scheduler, len(self._table.retained), self.log.step)

    def snapshot(self) -> EngineSnapshot:
        """Every block of every KV group, the requests `requests()` lists and the counters, all from the same moment."""
        with self._lock:
            tier = tier_view(self.kv, self._promotions)
            return EngineSnapshot(time.time(), self.stats(), block_views(self.kv), tuple(self.requests()), tier)

    def check_invariants(self) -> None:
        """Raise InvariantError if a KV invariant is broken, a request's table disagrees with its status,
        or the engine keeps anything for a request that left (engine/core/request_invariants.py)."""
        with self._lock:
            self.kv.check_invariants()
            check_request_state(self._table, self.kv, self.scheduler, self._generators.keys())

    # ------------------------------------------------------------------ helpers
    def _view(self, request: Request) -> RequestView:
        tables = self.kv.block_ids(request.request_id) if self.kv.has_table(request.request_id) else None
        return RequestView.of(request, tables or request.final_block_tables)

    def _publish(self, events: list[Event], changed: list[Request]) -> None:
        if self._promotions is not None:
            self._promotions.on_events(events)
        if not self._listeners:
            return
        views = [self._view(r) for r in changed]
        for listener in self._listeners:
            listener(events, views)

    def _claim_id(self, request_id: str | None, taken: set[str] | frozenset[str] = frozenset()) -> str:
        """A free request id (`RequestTable.claim_id`); a retired engine claims none (ValueError)."""
        if self._retired is not None:
            raise ValueError(f"this engine takes no new requests: {self._retired}; reload the page for the new one")
        return self._table.claim_id(request_id, taken)

    def _never_fits(self, request: Request) -> str | None:
        """Why the request can never fit in the pool (engine/core/admission.py's rule), or None."""
        sampling, size = request.sampling, self.config.block_size
        return never_fits(request.num_prompt_tokens, sampling.max_new_tokens, size, self.num_blocks)

    def _enqueue(self, request: Request) -> None:
        """Record and queue a validated request, or record it as rejected when it can never fit."""
        reason = self._never_fits(request)
        if request.sampling.temperature > 0 and reason is None:  # before anything is recorded
            seed = request.sampling.seed if request.sampling.seed is not None else self.config.seed
            self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        if reason is not None:  # recorded among the recently ended, never live
            request.rejected("too large for the pool")
            self._table.settle(request, self._view)
            detail = {"reason": reason}
            self.log.emit(EventKind.REJECT, detail, request_id=request.request_id, tokens=request.num_prompt_tokens)
            self._publish(self.log.take(), [request])
            raise RequestRejected(f"request {request.request_id!r} rejected: {reason}")
        self._table.settle(request, self._view)
        self.scheduler.add(request)
        # The prompt and the salt let the history explain later misses (analysis/why.py reads them).
        detail = {"parent_id": request.parent_id, "salt": request.salt, "prompt_token_ids": request.prompt_token_ids}
        self.log.emit(EventKind.SUBMIT, detail, request_id=request.request_id, tokens=request.num_prompt_tokens)
        self._publish(self.log.take(), [request])
        self._work.notify_all()
