"""The engine the console shows, shared by every browser session.

    host = get_host()            # st.cache_resource: created once, shut down on release
    console = host.console       # the engine, its run id and its stats samples
    host.restart(new_config)     # Settings: a new engine (and a new run) replaces the old one

Two ways to have an engine:
    attached     PREFIX_CONSOLE_ENGINE=http://127.0.0.1:8000 (what `make run` sets): the engine is an engine
                 server's process (`python -m cli serve`), driven through `serving.remote_engine.RemoteEngine`
                 with the engine's own method names. The console restarting or crashing never stops it or its
                 clients' streams; its restart (Settings, or the server's) is noticed by its boot id and the
                 console follows. The history is the server's (its `--db`), written by the engine process.
    embedded     no PREFIX_CONSOLE_ENGINE: the engine steps on a background thread of this process, with its
                 own history writer process (the page tests' way; `streamlit run app` alone).

Embedded: a listener, called on the engine thread after every step, feeds the storage writer process
(through `storage.write.recorder.persistence_listener`) and a bounded ring of `PoolStats` samples for the
Overview charts. When the configuration asks (PREFIX_CONSOLE_KV_EVENTS_ENDPOINT, ..._METRICS_PORT), each
engine also publishes vLLM's KV-event feed and /metrics (`engine.feeds.outbound.open_feeds`); a restart
closes the old engine's feeds before the new engine opens its own. Nothing here calls `st.*` except the
cached constructor at the bottom, so the engine thread never touches Streamlit. Each engine numbers its
generated request ids ("req-N") on from the highest one in the history.

Configuration comes from environment variables (see `config_from_env`) and, after a restart, from the
Settings page. The history database is `storage.db.default_db_url(data_dir)`: $PREFIX_CONSOLE_DB_URL, else
the attached server's database, else `history.sqlite` in the configuration's data directory."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import streamlit as st
from sqlalchemy import Engine as DbEngine
from sqlalchemy.exc import SQLAlchemyError

from app.loading import ENV_MODEL, HOST_STARTED
from engine.core.config import DEFAULT_MODEL, EngineConfig, shares_disk_tier
from engine.engine import Engine
from engine.core.events import Event
from engine.feeds.outbound import EngineFeeds, open_feeds
from serving.remote_engine import EngineUnreachable, RemoteEngine, wait_for_server
from engine.core.snapshot import PoolStats, RequestView
from storage import migrate
from storage.db import db_engine, default_db_url
from storage.read.queries import next_request_number
from storage.write.recorder import persistence_listener, run_info
from storage.write.writer import WriterStats
from storage.write.writer_process import WriterProcess

logger = logging.getLogger(__name__)

ENV_NUM_BLOCKS = "PREFIX_CONSOLE_NUM_BLOCKS"
ENV_BLOCK_SIZE = "PREFIX_CONSOLE_BLOCK_SIZE"
ENV_DEVICE = "PREFIX_CONSOLE_DEVICE"
ENV_DTYPE = "PREFIX_CONSOLE_DTYPE"
ENV_DATA_DIR = "PREFIX_CONSOLE_DATA_DIR"
ENV_ATTENTION = "PREFIX_CONSOLE_ATTENTION"  # attention override: "sliding:W" or "hybrid:W"
ENV_KV_EVENTS_ENDPOINT = "PREFIX_CONSOLE_KV_EVENTS_ENDPOINT"  # publish vLLM's KV-event feed here (PUB)
ENV_KV_EVENTS_REPLAY = "PREFIX_CONSOLE_KV_EVENTS_REPLAY_ENDPOINT"  # and its replay socket (ROUTER)
ENV_KV_EVENTS_TOPIC = "PREFIX_CONSOLE_KV_EVENTS_TOPIC"  # the feed's topic
ENV_METRICS_PORT = "PREFIX_CONSOLE_METRICS_PORT"  # vLLM-named /metrics on 127.0.0.1:PORT
ENV_ENGINE = "PREFIX_CONSOLE_ENGINE"  # attach to the engine server at this URL (`make run` sets it)
ENV_OFFLOAD_DIR = "PREFIX_CONSOLE_OFFLOAD_DIR"  # the embedded engine's disk KV tier: its directory
ENV_OFFLOAD_GIB = "PREFIX_CONSOLE_OFFLOAD_GIB"  # and its size in GiB (both, or neither: no tier)

HISTORY_SAMPLES = 3600  # PoolStats samples kept for the Overview charts
HISTORY_INTERVAL_S = 0.5  # at most one sample per this many seconds
RESTART_REASON = "the engine was restarted"  # finish reason of the requests a restart aborts
ATTACH_TIMEOUT_S = 120.0  # how long the console waits for an engine server that is still loading
BOOT_CHECK_S = 2.0  # how often an attached console asks whether its engine was restarted


def config_from_env(environ: Mapping[str, str] | None = None) -> EngineConfig:
    """The engine configuration the console starts with.

    Reads PREFIX_CONSOLE_MODEL (default "smollm2"), PREFIX_CONSOLE_NUM_BLOCKS, PREFIX_CONSOLE_BLOCK_SIZE,
    PREFIX_CONSOLE_DEVICE, PREFIX_CONSOLE_DTYPE, PREFIX_CONSOLE_DATA_DIR and the opt-in feeds
    PREFIX_CONSOLE_KV_EVENTS_ENDPOINT, PREFIX_CONSOLE_KV_EVENTS_REPLAY_ENDPOINT, PREFIX_CONSOLE_KV_EVENTS_TOPIC,
    PREFIX_CONSOLE_METRICS_PORT, and the disk KV tier PREFIX_CONSOLE_OFFLOAD_DIR with PREFIX_CONSOLE_OFFLOAD_GIB;
    unset means the EngineConfig default.

    Raises:
        ValueError: a variable that is not a valid value (the message names it).
    """
    env = os.environ if environ is None else environ
    fields: dict[str, object] = {"model": env.get(ENV_MODEL) or DEFAULT_MODEL}
    int_fields = ((ENV_NUM_BLOCKS, "num_blocks"), (ENV_BLOCK_SIZE, "block_size"), (ENV_METRICS_PORT, "metrics_port"))
    for name, key in int_fields:
        text = env.get(name)
        if text:
            try:
                fields[key] = int(text)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {text!r}") from None
    text_fields = (
        (ENV_DEVICE, "device"),
        (ENV_DTYPE, "dtype"),
        (ENV_ATTENTION, "attention_override"),
        (ENV_KV_EVENTS_ENDPOINT, "kv_events_endpoint"),
        (ENV_KV_EVENTS_REPLAY, "kv_events_replay_endpoint"),
        (ENV_KV_EVENTS_TOPIC, "kv_events_topic"),
    )
    for name, key in text_fields:
        if env.get(name):
            fields[key] = env[name]
    if env.get(ENV_DATA_DIR):
        fields["data_dir"] = Path(env[ENV_DATA_DIR]).resolve()
    if env.get(ENV_OFFLOAD_DIR):
        fields["offload_dir"] = Path(env[ENV_OFFLOAD_DIR]).resolve()
    if env.get(ENV_OFFLOAD_GIB):
        try:
            fields["offload_gib"] = float(env[ENV_OFFLOAD_GIB])
        except ValueError:
            raise ValueError(f"{ENV_OFFLOAD_GIB} must be a number of GiB, got {env[ENV_OFFLOAD_GIB]!r}") from None
    try:
        return EngineConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"invalid console configuration from the environment: {exc}") from None


def engine_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The engine server to attach to ($PREFIX_CONSOLE_ENGINE, e.g. http://127.0.0.1:8000), or None.

    Raises:
        ValueError: a value that is not an http:// or https:// URL.
    """
    env = os.environ if environ is None else environ
    url = (env.get(ENV_ENGINE) or "").strip()
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{ENV_ENGINE} must be an http:// URL such as http://127.0.0.1:8000, got {url!r}")
    return url.rstrip("/")


class StatsHistory:
    """A bounded ring of (time, PoolStats) samples; written on the engine thread, read by pages."""

    def __init__(self, maxlen: int = HISTORY_SAMPLES, min_interval_s: float = HISTORY_INTERVAL_S) -> None:
        self._samples: deque[tuple[float, PoolStats]] = deque(maxlen=maxlen)
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()

    def offer(self, now: float, stats: PoolStats, *, force: bool = False) -> None:
        """Keep `stats` unless the newest sample is younger than the minimum interval."""
        with self._lock:
            if force or not self._samples or now - self._samples[-1][0] >= self._min_interval_s:
                self._samples.append((now, stats))

    def samples(self) -> list[tuple[float, PoolStats]]:
        with self._lock:
            return list(self._samples)


@dataclass
class Console:
    """One running engine and what the console keeps about it in memory."""

    config: EngineConfig  # what it was started with
    engine: Engine
    run_id: str  # the storage run its events and requests are written under
    started_at: float  # epoch seconds
    history: StatsHistory = field(default_factory=StatsHistory)
    listener_errors: int = 0  # listener calls that raised (logged; the engine keeps stepping)
    active: bool = True  # False once a restart replaced it; its listener then ignores late calls
    feeds: EngineFeeds | None = None  # its KV-event feed and /metrics, when configured and bound
    feed_error: str | None = None  # why the configured feeds could not be opened

    @property
    def tokenizer(self):
        return self.engine.tokenizer


class ConsoleHost:
    """Owns the shared engine, the history writer and a read-only database handle."""

    api_url: str | None = None  # an embedded engine serves no API (`python -m cli serve` does)

    def __init__(self, config: EngineConfig, db_url: str | None = None) -> None:
        self.db_url = db_url or default_db_url(config.resolved_data_dir)
        self.db: DbEngine = db_engine(self.db_url)  # for the pages' reads (storage.read.queries)
        self.schema_error: str | None = None
        try:
            migrate.upgrade(self.db)  # so pages can read before the writer's first batch lands
        except Exception as exc:  # reported on the pages; the writer keeps retrying on its own
            self.schema_error = f"{type(exc).__name__}: {exc}"
        self.writer = WriterProcess(self.db_url)  # the database work runs in its own process
        self._lock = threading.RLock()
        self._closed = False
        try:
            self._console = self._launch(config)
        except BaseException:
            self.writer.close(timeout_s=5)
            self.db.dispose()
            raise

    @classmethod
    def from_env(cls) -> ConsoleHost:
        return cls(config_from_env())

    @property
    def console(self) -> Console:
        with self._lock:
            return self._console

    def writer_stats(self) -> WriterStats:
        return self.writer.stats()

    def restart(self, config: EngineConfig) -> Console:
        """Replace the running engine with one built from `config` (a new storage run).

        The new engine is built first: when that fails (a bad model path, not enough memory) the old
        one keeps serving and the error propagates. The old engine's unfinished requests end aborted
        (retained ones released), recorded under the old run, so no block of it stays held; a session
        that still holds it is refused with a message when it submits. The new engine's generated ids
        continue past the old one's and the history's.

        A new engine on the old one's disk tier directory takes the tier over: the old engine stops and
        closes it first (its pool's cached blocks written back), then the new one opens it warm; when the
        new one fails to build, an engine of the old configuration is started again on the same tier
        (warm) and the error propagates.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the console host is shut down")
            old = self._console
            first_number = self._first_request_number()
            if shares_disk_tier(old.engine.config, config):
                old.engine.close()
                try:
                    engine = Engine(config, first_request_number=first_number)
                except BaseException:
                    self._retire(old)
                    number = max(first_number, old.engine.next_request_number)
                    self._console = self._launch(old.engine.config, Engine(old.engine.config, first_request_number=number))
                    raise
            else:
                engine = Engine(config, first_request_number=first_number)
            self._retire(old)
            # Past the old engine's ids too, now that it claims no more: it served while the new one loaded,
            # and its newest requests may not be written yet.
            engine.next_request_number = max(engine.next_request_number, old.engine.next_request_number)
            self._console = self._launch(config, engine)
            return self._console

    @staticmethod
    def _retire(old: Console) -> None:
        """Stop the old console's engine and end its requests (recorded under its run: its listener is still
        active), then silence its listener and close its feeds (freeing their endpoints for the next engine)."""
        old.engine.stop()
        old.engine.retire(RESTART_REASON)
        old.active = False
        if old.feeds is not None:
            old.feeds.close()  # after the ends are published

    def shutdown(self) -> None:
        """Stop the engine thread, mark the run stopped and flush the writer. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._console.engine.close()  # its write-back to the disk tier is recorded, then nothing more
            self._console.active = False
            if self._console.feeds is not None:
                self._console.feeds.close()
        self.writer.close(timeout_s=10)
        self.db.dispose()

    def _first_request_number(self) -> int:
        """Where a new engine's generated ids start: past every "req-N" in the history, so that no id repeats
        across its runs (0 when the history cannot be read; the pages show why)."""
        try:
            return next_request_number(self.db)
        except SQLAlchemyError:
            logger.exception("the history's request ids could not be read; new ids may repeat older runs'")
            return 0

    def _launch(self, config: EngineConfig, engine: Engine | None = None) -> Console:
        engine = engine or Engine(config, first_request_number=self._first_request_number())
        engine.warm_up()  # the first request would otherwise pay a first forward's one-time costs
        started = time.time()
        run_id = self.writer.start_run(run_info(engine, started))
        console = Console(config=config, engine=engine, run_id=run_id, started_at=started)
        console.history.offer(started, engine.stats(), force=True)
        engine.add_listener(self._listener(console))
        try:
            console.feeds = open_feeds(engine)
        except Exception as exc:  # an endpoint in use or malformed: shown on the pages, the engine still runs
            console.feed_error = f"{type(exc).__name__}: {exc}"
            logger.exception("the engine's KV-event feed or metrics endpoint could not be opened")
        engine.start()
        return console

    def _listener(self, console: Console):
        persist = persistence_listener(self.writer)

        def on_step(events: list[Event], views: list[RequestView]) -> None:
            if not console.active:
                return
            try:
                persist(events, views)
                console.history.offer(time.time(), console.engine.stats())
            except Exception:  # a listener must never stop the engine; counted and shown instead
                console.listener_errors += 1
                logger.exception("console listener failed")

        return on_step


class AttachedWriter:
    """The history writer of an attached engine (it runs beside the engine process), as pages ask of one:
    `mark`, `wait` and `stats`, answered from what the engine server publishes."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def mark(self) -> int:
        """A mark for every row the engine handed its writer so far (0 without a history)."""
        return self._engine.writer_mark() or 0

    def wait(self, mark: int, timeout_s: float | None = None) -> bool:
        """Wait until the rows up to `mark` are written or dropped; False when `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.stats().done_mark < mark:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        return self.wait(self.mark(), timeout_s)

    def stats(self) -> WriterStats:
        written = self._engine.published().writer
        if written is None:  # the server keeps no history: nothing is queued, nothing lost
            return WriterStats(queued=0, written_events=0, written_requests=0, written_batches=0, dropped=0,
                               failed_batches=0, retries=0, retrying=False, last_error=None, schema_ready=True,
                               pruned_rows=0, done_mark=1 << 62)  # fmt: skip
        return WriterStats(**written)


class RemoteSamples:
    """The Overview's stats samples of an attached engine: the server's bounded ring."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def samples(self) -> list[tuple[float, PoolStats]]:
        return self._engine.stats_history()

    def offer(self, now: float, stats: PoolStats, *, force: bool = False) -> None:
        """Nothing to add: the server samples its engine by itself, idle too (every second or so)."""


class AttachedHost:
    """The console of an engine server it did not start (see the module docstring): the same answers as
    `ConsoleHost` (`console`, `db`, `writer`, `restart`, `shutdown`), the engine behind HTTP."""

    def __init__(self, url: str, db_url: str | None = None, *, timeout_s: float = ATTACH_TIMEOUT_S) -> None:
        self.api_url = url
        engine = wait_for_server(url, timeout_s)
        self.db_url = db_url or engine.db_url or default_db_url(engine.config.resolved_data_dir)
        self.db: DbEngine = db_engine(self.db_url)
        self.schema_error: str | None = None
        try:
            migrate.upgrade(self.db)
        except Exception as exc:  # reported on the pages
            self.schema_error = f"{type(exc).__name__}: {exc}"
        self.engine_error: str | None = None  # why the server does not answer now (shown; pages wait)
        self._lock = threading.Lock()
        self._console = self._console_of(engine)
        self._checked_at = time.monotonic()

    @classmethod
    def from_env(cls, url: str) -> AttachedHost:
        return cls(url, os.environ.get("PREFIX_CONSOLE_DB_URL") or None)

    @staticmethod
    def _console_of(engine: RemoteEngine) -> Console:
        return Console(config=engine.config, engine=engine, run_id=engine.run_id or "", started_at=engine.info.started_at,
                       history=RemoteSamples(engine))  # type: ignore[arg-type]  # fmt: skip

    @property
    def console(self) -> Console:
        """The attached engine; a restart of it (a new boot id) is followed here, at most BOOT_CHECK_S late."""
        with self._lock:
            if time.monotonic() - self._checked_at >= BOOT_CHECK_S:
                self._checked_at = time.monotonic()
                engine = self._console.engine
                try:
                    if engine.current_boot_id() != engine.boot_id:
                        engine.refresh()
                        self._console = self._console_of(engine)
                    self.engine_error = None
                except EngineUnreachable as exc:
                    self.engine_error = str(exc)
            return self._console

    @property
    def writer(self) -> AttachedWriter:
        return AttachedWriter(self._console.engine)

    def writer_stats(self) -> WriterStats:
        return self.writer.stats()

    def restart(self, config: EngineConfig) -> Console:
        """Have the server replace its engine process (see `serving.console_routes.EngineHolder.restart`).

        Raises:
            ValueError: the new engine could not start; the old one still serves.
        """
        with self._lock:
            engine = self._console.engine
            engine.restart(config)
            self._console = self._console_of(engine)
            return self._console

    def shutdown(self) -> None:
        """Let go of the server (it and its engine go on)."""
        self._console.engine.close()
        self.db.dispose()


@st.cache_resource(show_spinner="Loading the model and starting the engine…", on_release=lambda host: host.shutdown())
def get_host() -> ConsoleHost | AttachedHost:
    """The process-wide host (created on first use, shared by every session): attached to the engine server
    $PREFIX_CONSOLE_ENGINE names, else an embedded engine."""
    url = engine_url_from_env()
    host = AttachedHost.from_env(url) if url is not None else ConsoleHost.from_env()
    atexit.register(_shutdown_at_exit, weakref.ref(host))  # on_release is not guaranteed at server shutdown
    HOST_STARTED.set()
    return host


def _shutdown_at_exit(host_ref: weakref.ref[ConsoleHost | AttachedHost]) -> None:
    host = host_ref()
    if host is not None:
        host.shutdown()
