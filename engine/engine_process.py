"""The engine stepping in a process of its own, as vLLM V1 runs its EngineCore.

    spec = EngineProcessSpec(config, inbox="ipc:///tmp/x/in", outbox="ipc:///tmp/x/out", history=None)
    multiprocessing.get_context("spawn").Process(target=run_engine_process, args=(spec,)).start()

The process owns the model, the KV pool, the scheduler and (with `history`, storage's `EngineHistory`,
which this module knows only by its methods) the history writer. Its loop:

    drain the inbox          every command that arrived (submit, fork, release, abort, reset, get, ...)
    step                     one schedule + forward + post-process, when there is work
    publish                  one STEP message: what changed for each request, the stats when due

Nothing a client does waits for a forward, and nothing in here waits for a client: commands queue in
the inbox socket while a step runs and are applied, in order, before the next one; their replies and
every step's updates leave through the outbox (ZeroMQ PUSH/PULL over ipc://, pickle frames: the peer
is the parent that spawned this process and created both endpoints in a private directory).

Messages out (tuples, the first item the kind):
    (READY, info)                        the engine is loaded and warmed up (`EngineInfo`)
    (START_FAILED, message)              it could not be built; the process exits
    (REPLY, call_id, ok, value)          a command's result, or (ok False) its error as (type name, message)
    (STEP, updates, stats, metrics)      after each step or command batch: `RequestUpdate`s, then
                                         `PublishedStats` and the Prometheus text when due (else None)
    (SNAPSHOT, EngineSnapshot)           while a client wants them (WANT_SNAPSHOTS), at most every
                                         SNAPSHOT_INTERVAL_S, and on SNAPSHOT
    (DIED, message)                      the loop failed; the process exits

Invariants:
    * Commands are applied on the loop's thread only, between steps, in arrival order.
    * A request's updates carry its new output tokens exactly once and in order; `sent` holds an entry
      per request that has not ended, so it is bounded by the live requests (the check_invariants
      command checks it beside the engine's own invariants).
    * On STOP, SIGTERM, or its parent's death (checked every loop) the engine stops, the history writer
      flushes, and the process exits. SIGINT is the parent's to handle (a terminal's Ctrl-C reaches the
      whole process group): the parent sends STOP.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from engine.core.config import EngineConfig
from engine.core.errors import require
from engine.core.snapshot import PoolStats, RequestView

logger = logging.getLogger(__name__)

READY, START_FAILED, REPLY, STEP, SNAPSHOT, DIED = "ready", "start_failed", "reply", "step", "snapshot", "died"
STATS_INTERVAL_S = 0.5  # stats ride on a STEP message at most this often (the Overview's samples)
METRICS_INTERVAL_S = 1.0  # the Prometheus text at most this often
SNAPSHOT_INTERVAL_S = 0.5  # snapshots while wanted
IDLE_POLL_MS = 1000  # an idle engine wakes this often to publish what is due
# Commands the loop applies by calling the engine method of the same name (with the given arguments).
ENGINE_COMMANDS = frozenset(
    {"submit", "fork_many", "release", "abort", "reset_cache", "get", "requests", "retire", "check_invariants"}
)
STOP, SNAPSHOT_NOW, WANT_SNAPSHOTS = "stop", "snapshot", "want_snapshots"
WRITER_MARK = "writer_mark"  # replies with the history writer's mark (None without a writer)


@dataclass(frozen=True)
class EngineProcessSpec:
    """What the child needs to start: the engine's configuration and where to talk."""

    config: EngineConfig
    inbox: str  # ZeroMQ endpoint the parent PUSHes commands to (the child connects a PULL)
    outbox: str  # ZeroMQ endpoint the child PUSHes messages to (the parent binds a PULL)
    history: Any = None  # storage.write.recorder.EngineHistory (next_request_number, open, writer, close), or None


@dataclass(frozen=True)
class EngineInfo:
    """The engine's fixed facts, sent once with READY (the API validates and names things with them)."""

    model_id: str
    weights_revision: str
    device: str
    dtype: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    attention_spec: tuple[str, ...]
    group_names: tuple[str, ...]
    forward_path: str
    kernels: str
    run_id: str | None  # the history run, when a database was given
    started_at: float
    pid: int


class RequestUpdate(NamedTuple):
    """What changed for one request in one step (the API's streams read these)."""

    request_id: str
    status: str  # a RequestStatus value
    new_token_ids: tuple[int, ...]  # output tokens since its previous update
    finish_reason: str | None
    cached_tokens: int  # hit position at first schedule
    num_prompt_tokens: int
    new_logprobs: tuple[Any, ...] = ()  # per new token, when the request asked for logprobs
    disk_cached_tokens: int = 0  # of `cached_tokens`, those read from the disk tier


class PublishedStats(NamedTuple):
    """The engine's counters and its history writer's progress, as of one moment."""

    pool: PoolStats
    forward_threads: int
    forward_seconds: dict[int, float]  # seconds stepped at each thread count (empty: no governor)
    writer: Any  # storage's WriterStats (its `done_mark`: every row up to that mark is written), or None


def engine_info(engine: Any, run_id: str | None, started_at: float) -> EngineInfo:
    loaded = engine.loaded
    return EngineInfo(
        model_id=str(loaded.model_id),
        weights_revision=loaded.weights_revision,
        device=str(loaded.device),
        dtype=engine.config.dtype,
        block_size=engine.config.block_size,
        num_blocks=engine.num_blocks,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        num_layers=loaded.num_layers,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        num_parameters=loaded.num_parameters,
        attention_spec=tuple(loaded.attention_spec),
        group_names=tuple(g.name for g in engine.stats().groups),
        forward_path=engine.runner.forward_path,
        kernels=engine.runner.kernels.summary(),
        run_id=run_id,
        started_at=started_at,
        pid=os.getpid(),
    )


class UpdateTracker:
    """Turns changed `RequestView`s into `RequestUpdate`s carrying only the new tokens (see the invariants)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # request id -> output tokens already sent, for requests not ended

    def updates(self, views: list[RequestView]) -> list[RequestUpdate]:
        latest: dict[str, RequestView] = {}
        for view in views:  # a request changed by a command and by the step: its newest view only
            latest[view.request_id] = view
        out = []
        for rid, view in latest.items():
            sent = self.sent.get(rid, 0)
            outputs = view.output_token_ids
            logprobs = getattr(view, "output_logprobs", None) or ()
            if view.is_final:
                self.sent.pop(rid, None)
            else:
                self.sent[rid] = len(outputs)
            out.append(
                RequestUpdate(rid, str(getattr(view.status, "value", view.status)), tuple(outputs[sent:]),
                              view.finish_reason, view.cached_tokens, view.num_prompt_tokens,
                              tuple(logprobs[sent:]), view.disk_cached_tokens)  # fmt: skip
            )
        return out


def run_engine_process(spec: EngineProcessSpec) -> None:
    """The child's entry point: build the engine, say READY, loop until STOP. Never raises."""
    import zmq

    from engine.openmp import set_openmp_defaults

    set_openmp_defaults()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides (it sends STOP)
    parent = os.getppid()
    context = zmq.Context()
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(spec.outbox)
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(spec.inbox)

    def send(*message: Any) -> None:
        outbox.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        core = _EngineLoop.start(spec, send)
    except BaseException as exc:  # a bad model path, a database that cannot be used: the parent says why
        logger.exception("the engine could not start")
        send(START_FAILED, f"{type(exc).__name__}: {exc}")
        outbox.close()
        inbox.close()
        context.term()
        return
    signal.signal(signal.SIGTERM, lambda *_: core.stop())
    try:
        core.run(inbox, parent)
    except BaseException as exc:
        logger.exception("the engine loop died")
        send(DIED, f"{type(exc).__name__}: {exc}")
    finally:
        core.close()
        outbox.close()
        inbox.close()
        context.term()


class _EngineLoop:
    """The engine and what the loop keeps beside it (the child's side of the module docstring)."""

    def __init__(self, engine: Any, history: Any, feeds: Any, send: Any) -> None:
        from engine.feeds.metrics_server import BlockResidency, engine_registry

        self.engine = engine
        self.history = history
        self.writer = None if history is None else history.writer
        self.feeds = feeds
        self._send = send
        self._changed: list[RequestView] = []
        self._tracker = UpdateTracker()
        self._residency = BlockResidency()
        engine.add_listener(self._residency.on_step)
        engine.add_listener(self._collect)
        self._registry = engine_registry(engine, self._residency)
        self._stats_at = self._metrics_at = self._snapshot_at = 0.0
        self._snapshots_until = 0.0  # a client wants snapshots until then (monotonic)
        self._snapshot_due = False
        self._stopping = False

    @classmethod
    def start(cls, spec: EngineProcessSpec, send: Any) -> _EngineLoop:
        from engine.engine import Engine
        from engine.feeds.outbound import open_feeds

        history = spec.history
        first_number = 0 if history is None else history.next_request_number()
        engine = Engine(spec.config, first_request_number=first_number)
        engine.warm_up()
        started = time.time()
        run_id = None if history is None else history.open(engine)
        try:
            feeds = open_feeds(engine)
        except BaseException:
            if history is not None:
                history.close()
            raise
        loop = cls(engine, history, feeds, send)
        send(READY, engine_info(engine, run_id, started))
        return loop

    def _collect(self, events: list[Any], views: list[RequestView]) -> None:
        self._changed.extend(views)

    def stop(self) -> None:
        """Stop after the current step (a signal handler may call it)."""
        self._stopping = True

    def run(self, inbox: Any, parent: int) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        while not self._stopping:
            if os.getppid() != parent:  # the server died (kill -9): nobody reads the outbox any more
                logger.warning("the engine's parent process is gone; stopping")
                return
            busy = self.engine.has_work()
            timeout = 0 if busy else IDLE_POLL_MS
            while poller.poll(timeout):  # drain: everything that arrived, without waiting once there is some
                self._apply(pickle.loads(inbox.recv()))
                timeout = 0
                if self._stopping:
                    return
            if self.engine.has_work():
                self.engine.step()
            self._publish()

    def _apply(self, command: tuple[Any, ...]) -> None:
        call_id, name, args, kwargs = command
        if name == STOP:
            self._stopping = True
            return
        if name == WANT_SNAPSHOTS:
            self._snapshots_until = time.monotonic() + float(args[0])
            return
        if name == SNAPSHOT_NOW:
            self._snapshot_due = True
            return
        if name == WRITER_MARK:
            self._stats_at = 0.0  # the writer's progress goes out with the next stats
            self._send(REPLY, call_id, True, None if self.writer is None else self.writer.mark())
            return
        try:
            if name not in ENGINE_COMMANDS:
                raise ValueError(f"unknown engine command {name!r}")
            command_of = self._check_invariants if name == "check_invariants" else getattr(self.engine, name)
            value = command_of(*args, **kwargs)
        except Exception as exc:  # the client's error: its reply says why, the engine goes on
            if call_id is not None:
                self._send(REPLY, call_id, False, (type(exc).__name__, str(exc)))
            return
        if call_id is not None:
            self._send(REPLY, call_id, True, value)

    def _check_invariants(self) -> None:
        """The engine's invariants, and this loop's bound: new tokens are tracked only for live requests.

        Raises:
            InvariantError: either is broken.
        """
        self.engine.check_invariants()
        self._publish()  # the views changed so far reach the tracker first
        live = {view.request_id for view in self.engine.requests() if not view.is_final}
        stale = set(self._tracker.sent) - live
        require(not stale, f"output tracked for {len(stale)} ended requests, e.g. {sorted(stale)[:3]}")

    def _publish(self) -> None:
        now = time.monotonic()
        updates = self._tracker.updates(self._changed) if self._changed else []
        self._changed = []
        stats = metrics = None
        settled = bool(updates) and not self.engine.has_work()  # the last step of a burst: its numbers now
        if settled or now - self._stats_at >= STATS_INTERVAL_S:
            stats, self._stats_at = self._stats(), now
        if settled or now - self._metrics_at >= METRICS_INTERVAL_S:
            from prometheus_client import generate_latest

            metrics, self._metrics_at = generate_latest(self._registry), now
        if updates or stats is not None or metrics is not None:
            self._send(STEP, updates, stats, metrics)
        wanted = now < self._snapshots_until and now - self._snapshot_at >= SNAPSHOT_INTERVAL_S
        if self._snapshot_due or wanted:
            self._snapshot_due, self._snapshot_at = False, now
            self._send(SNAPSHOT, self.engine.snapshot())

    def _stats(self) -> PublishedStats:
        writer = self.writer
        return PublishedStats(self.engine.stats(), self.engine.forward_threads(), self.engine.forward_time_at_threads(),
                              None if writer is None else writer.stats())  # fmt: skip

    def close(self) -> None:
        self.engine.close()
        if self.feeds is not None:
            self.feeds.close()
        if self.history is not None:
            self.history.close()

