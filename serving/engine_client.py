"""The client side of an engine process (engine/engine_process.py): start it, send it commands, hear it.

    client = EngineClient.start(config, db_url="sqlite:///data/history.sqlite")   # returns once READY
    request_id = await client.call_async("submit", prompt, sampling, request_id="cmpl-...")
    client.add_listener(on_updates)           # called on the receiver thread with each step's updates
    client.stats(); client.metrics_text(); client.snapshot()
    client.close()                            # STOP, then the process exits (its writer flushes first)

One receiver thread reads the engine's outbox: replies complete their futures, STEP messages go to the
listeners (the API's gateway, which hands them to its event loops) and refresh the newest stats and
Prometheus text, SNAPSHOT messages refresh the newest snapshot. Nothing here waits for a forward except
a caller who asks for a reply (`call`), and `call_async` waits on the caller's event loop without
blocking it.

Invariants:
    * Sends happen under one lock (a ZeroMQ socket is not thread-safe).
    * Every pending call ends: with its reply, or with `EngineGone` when the process dies or is closed.
    * `stats_history` keeps at most HISTORY_SAMPLES samples, at least HISTORY_INTERVAL_S apart.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from engine.core.config import EngineConfig
from storage.write.recorder import EngineHistory
from engine.core.snapshot import EngineSnapshot, PoolStats
from engine.engine_process import (
    DIED, READY, REPLY, SNAPSHOT, SNAPSHOT_NOW, START_FAILED, STEP, STOP, WANT_SNAPSHOTS,
    EngineInfo, EngineProcessSpec, PublishedStats, RequestUpdate, run_engine_process,
)  # fmt: skip

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # the first start converts SmolLM2's GGUF (tens of seconds on a busy machine)
STOP_TIMEOUT_S = 30.0
HISTORY_SAMPLES = 3600  # stats samples kept for the Overview charts
HISTORY_INTERVAL_S = 0.5
SNAPSHOT_WANT_S = 30.0  # after a read, the engine publishes snapshots this long
SNAPSHOT_FRESH_S = 1.0  # a snapshot younger than this is served as it is
UpdateListener = Callable[[list[RequestUpdate]], None]


class EngineGone(RuntimeError):
    """The engine process is not running (it died, failed to start, or was closed)."""


class EngineCommandError(ValueError):
    """The engine refused a command; `kind` is the engine's exception type name (e.g. RequestRejected)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EngineClient:
    """One running engine process and the parent's view of it (see the module docstring)."""

    def __init__(self, config: EngineConfig, info: EngineInfo, process: Any, sockets: tuple[Any, Any, Any], tmpdir: str,
                 tokenizer: Any):  # fmt: skip
        self.config = config
        self.tokenizer = tokenizer  # the model's, loaded by `start` (None for token-id-only models)
        self.info = info
        self._process = process
        self._context, self._inbox, self._outbox = sockets
        self._tmpdir = tmpdir
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._calls = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        self._listeners: list[UpdateListener] = []
        self._metrics = b""
        self._snapshot: tuple[float, EngineSnapshot] | None = None
        self._snapshot_arrived = threading.Condition(self._lock)
        self.stats_history: deque[tuple[float, PoolStats]] = deque(maxlen=HISTORY_SAMPLES)
        self.failure: str | None = None  # why the process stopped serving, once it has
        self.published: PublishedStats | None = None  # the newest counters (and writer progress) published
        self._closed = False
        self.boot_id = f"{info.pid}-{info.started_at:.6f}"  # changes with every engine start
        self._receiver = threading.Thread(target=self._receive, name="engine-client", daemon=True)
        self._receiver.start()

    # ------------------------------------------------------------------ start and stop
    @classmethod
    def start(cls, config: EngineConfig, *, db_url: str | None = None, timeout_s: float = START_TIMEOUT_S) -> EngineClient:
        """Spawn the engine process and return once it is loaded and warmed up, with the model's tokenizer
        loaded here meanwhile (importing transformers and torch takes seconds: a first request that paid for
        it waited 8-9 s, and the event loop with it).

        Raises:
            EngineGone: it could not start (the message is the engine's error), did not within `timeout_s`,
                or its tokenizer could not load here.
        """
        from engine.runner.model_loading import load_tokenizer  # torch and transformers: only once an engine starts

        tmpdir = tempfile.mkdtemp(prefix="prefix-engine-")
        context = zmq.Context()
        inbox = context.socket(zmq.PUSH)
        inbox.setsockopt(zmq.LINGER, 0)
        outbox = context.socket(zmq.PULL)
        outbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(f"ipc://{tmpdir}/inbox")
        outbox.bind(f"ipc://{tmpdir}/outbox")
        history = None if db_url is None else EngineHistory(db_url)  # opened in the engine process
        spec = EngineProcessSpec(config, f"ipc://{tmpdir}/inbox", f"ipc://{tmpdir}/outbox", history)
        process = multiprocessing.get_context("spawn").Process(target=run_engine_process, args=(spec,),
                                                               name="prefix-engine")  # fmt: skip
        process.start()
        try:
            tokenizer, problem = None, None
            try:
                tokenizer = load_tokenizer(config)  # on this core while the engine process loads on the other
            except (ValueError, OSError) as error:
                problem = error
            info = cls._await_ready(outbox, process, timeout_s)  # the engine's own error, when it has one, first
            if problem is not None:
                raise EngineGone(f"the model's tokenizer could not load: {problem}")
        except BaseException:
            process.kill()
            process.join(5)
            inbox.close()
            outbox.close()
            context.term()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        return cls(config, info, process, (context, inbox, outbox), tmpdir, tokenizer)

    @staticmethod
    def _await_ready(outbox: Any, process: Any, timeout_s: float) -> EngineInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if outbox.poll(200):
                message = pickle.loads(outbox.recv())
                if message[0] == READY:
                    return message[1]
                if message[0] == START_FAILED:
                    raise EngineGone(message[1])
            elif not process.is_alive():
                raise EngineGone(f"the engine process exited with code {process.exitcode} before it was ready")
        raise EngineGone(f"the engine did not start within {timeout_s:.0f} s")

    def close(self, reason: str | None = None) -> None:
        """End unfinished requests with `reason` (when given), stop the process and wait for it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.failure is None:
            if reason is not None:
                self._send(None, "retire", (reason,), {})
            self._send(None, STOP, (), {})
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            self._process.kill()
            self._process.join(5)
        self._fail("the engine was stopped")
        self._receiver.join(5)
        self._inbox.close()
        self._outbox.close()
        self._context.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ commands
    def call(self, name: str, *args: Any, **kwargs: Any) -> Future[Any]:
        """Send a command whose reply completes the future (EngineCommandError or EngineGone on failure)."""
        future: Future[Any] = Future()
        with self._lock:
            if self.failure is not None:
                future.set_exception(EngineGone(self.failure))
                return future
            call_id = next(self._calls)
            self._pending[call_id] = future
        self._send(call_id, name, args, kwargs)
        return future

    async def call_async(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """`call` awaited on the running event loop (the loop goes on meanwhile)."""
        return await asyncio.wrap_future(self.call(name, *args, **kwargs))

    def tell(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Send a command without waiting for anything (abort: the request's update says it ended)."""
        if self.failure is None:
            self._send(None, name, args, kwargs)

    def _send(self, call_id: int | None, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        frame = pickle.dumps((call_id, name, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if not self._inbox.closed:
                self._inbox.send(frame)

    # ------------------------------------------------------------------ what the engine published
    def add_listener(self, listener: UpdateListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: UpdateListener) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def stats(self) -> PoolStats | None:
        """The newest counters the engine published (None before the first)."""
        return None if self.published is None else self.published.pool

    def metrics_text(self) -> bytes:
        """The newest Prometheus exposition the engine rendered (at most METRICS_INTERVAL_S old while it runs)."""
        return self._metrics

    def snapshot(self, timeout_s: float = 30.0, *, after_commands: bool = False) -> EngineSnapshot:
        """A snapshot at most SNAPSHOT_FRESH_S old; asks for one (and for more for a while) when stale.
        `after_commands`: one taken after every command sent so far was applied (the engine's next step
        boundary), for a reader that must see what it just did.

        Raises:
            EngineGone: none came within `timeout_s`, or the process is gone.
        """
        with self._lock:
            fresh = self._snapshot is not None and time.monotonic() - self._snapshot[0] < SNAPSHOT_FRESH_S
            fresh = fresh and not after_commands
        self.tell(WANT_SNAPSHOTS, SNAPSHOT_WANT_S)
        if fresh and self._snapshot is not None:
            return self._snapshot[1]
        asked = time.monotonic()
        self.tell(SNAPSHOT_NOW)
        with self._snapshot_arrived:
            while self._snapshot is None or self._snapshot[0] < asked:
                if self.failure is not None:
                    raise EngineGone(self.failure)
                if not self._snapshot_arrived.wait(timeout=max(0.0, asked + timeout_s - time.monotonic())):
                    raise EngineGone(f"no snapshot from the engine within {timeout_s:.0f} s")
            return self._snapshot[1]

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def model_name(self) -> str:
        return self.info.model_id

    # ------------------------------------------------------------------ the receiver thread
    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outbox, zmq.POLLIN)
        while self.failure is None:
            try:
                ready = poller.poll(200)
            except zmq.ZMQError:
                return
            if not ready:
                if not self._process.is_alive():
                    self._fail(f"the engine process exited with code {self._process.exitcode}")
                continue
            message = pickle.loads(self._outbox.recv())
            try:
                self._dispatch(message)
            except Exception:  # a listener's bug must not stop the receiver
                logger.exception("an engine message could not be handled")

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == STEP:
            _, updates, stats, metrics = message
            if stats is not None:
                self.published = stats
                now = time.time()
                if not self.stats_history or now - self.stats_history[-1][0] >= HISTORY_INTERVAL_S:
                    self.stats_history.append((now, stats.pool))
            if metrics is not None:
                self._metrics = metrics
            if updates:
                with self._lock:
                    listeners = list(self._listeners)
                for listener in listeners:
                    listener(updates)
        elif kind == REPLY:
            _, call_id, ok, value = message
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is not None:
                future.set_result(value) if ok else future.set_exception(EngineCommandError(*value))
        elif kind == SNAPSHOT:
            with self._snapshot_arrived:
                self._snapshot = (time.monotonic(), message[1])
                self._snapshot_arrived.notify_all()
        elif kind == DIED:
            self._fail(f"the engine loop died: {message[1]}")

    def _fail(self, why: str) -> None:
        """The process serves no more: every pending call ends with EngineGone."""
        with self._lock:
            if self.failure is None:
                self.failure = why
            pending, self._pending = self._pending, {}
            self._snapshot_arrived.notify_all()
        for future in pending.values():
            future.set_exception(EngineGone(self.failure))
