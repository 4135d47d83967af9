"""The one engine per server process, shared by every browser session.

    host = get_host()            # st.cache_resource: created once, shut down on release
    console = host.console       # the running engine, its run id and its in-process history
    host.restart(new_config)     # Settings: a new engine (and a new run) replaces the old one

With PREFIX_CONSOLE_API_PORT (`make run` sets 8000) the host also serves the OpenAI-compatible API
(serving/api.py) on 127.0.0.1, over whichever engine is current: API requests land in the same engine,
history and pages as the console's own. A port that cannot be bound is shown; the console runs.
When the configuration asks (PREFIX_CONSOLE_KV_EVENTS_ENDPOINT, ..._METRICS_PORT), each engine also
publishes vLLM's KV-event feed and /metrics (`engine.feeds.outbound.open_feeds`); a restart closes the old
engine's feeds before the new engine opens its own. A feed that cannot bind is shown, the engine runs.

The engine steps on its own background thread. A listener, called on that thread after every step,
feeds the storage writer process (through `storage.write.recorder.persistence_listener`: events and request
views of the current run) and a bounded ring of `PoolStats` samples for the Overview charts. Block
histories are read back from the database (storage.read.queries.block_timelines), not kept here. Nothing here
calls `st.*` except the cached constructor at the bottom, so the engine thread never touches Streamlit.
The engine is warmed up (one throwaway forward) before it serves, so the first request is not slower.
Each engine numbers its generated request ids ("req-N") on from the highest one in the history, so the ids
of all runs (also of earlier console processes on the same database) never repeat.

Configuration comes from environment variables (see `config_from_env`) and, after a restart, from the
Settings page. The history database is `storage.db.default_db_url(data_dir)`: $PREFIX_CONSOLE_DB_URL, else
`history.sqlite` in the configuration's data directory.
"""

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
from engine.core.config import DEFAULT_MODEL, EngineConfig
from engine.engine import Engine
from engine.core.events import Event
from engine.feeds.outbound import EngineFeeds, open_feeds
from serving.server import ApiServer
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
ENV_API_PORT = "PREFIX_CONSOLE_API_PORT"  # the OpenAI-compatible API on 127.0.0.1:PORT; unset or "off": none

HISTORY_SAMPLES = 3600  # PoolStats samples kept for the Overview charts
HISTORY_INTERVAL_S = 0.5  # at most one sample per this many seconds
RESTART_REASON = "the engine was restarted"  # finish reason of the requests a restart aborts


def config_from_env(environ: Mapping[str, str] | None = None) -> EngineConfig:
    """The engine configuration the console starts with.

    Reads PREFIX_CONSOLE_MODEL (default "smollm2"), PREFIX_CONSOLE_NUM_BLOCKS, PREFIX_CONSOLE_BLOCK_SIZE,
    PREFIX_CONSOLE_DEVICE, PREFIX_CONSOLE_DTYPE, PREFIX_CONSOLE_DATA_DIR and the opt-in feeds
    PREFIX_CONSOLE_KV_EVENTS_ENDPOINT, PREFIX_CONSOLE_KV_EVENTS_REPLAY_ENDPOINT, PREFIX_CONSOLE_KV_EVENTS_TOPIC,
    PREFIX_CONSOLE_METRICS_PORT; unset means the EngineConfig default.

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
    try:
        return EngineConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"invalid console configuration from the environment: {exc}") from None


def api_port_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The port of the OpenAI-compatible API ($PREFIX_CONSOLE_API_PORT; `make run` sets 8000), or None for
    no API (unset, empty or "off").

    Raises:
        ValueError: a value that is neither "off" nor a port number.
    """
    env = os.environ if environ is None else environ
    text = (env.get(ENV_API_PORT) or "off").strip()
    if text == "off":
        return None
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ValueError(f"{ENV_API_PORT} must be a port number or 'off', got {text!r}")
    return int(text)


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

    def __init__(self, config: EngineConfig, db_url: str | None = None, api_port: int | None = None) -> None:
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
        self.api: ApiServer | None = None  # the OpenAI-compatible API over the current engine, when asked for
        self.api_error: str | None = None  # why it could not be started (shown on the pages)
        if api_port is not None:
            try:
                self.api = ApiServer(lambda: self.console.engine, port=api_port)
            except (OSError, RuntimeError) as exc:  # a port in use: shown, the console still runs
                self.api_error = f"{type(exc).__name__}: {exc}"
                logger.exception("the OpenAI-compatible API could not be started")

    @classmethod
    def from_env(cls) -> ConsoleHost:
        return cls(config_from_env(), api_port=api_port_from_env())

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
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the console host is shut down")
            old = self._console
            engine = Engine(config, first_request_number=self._first_request_number())
            old.engine.stop()
            old.engine.retire(RESTART_REASON)  # its listener is still active: the ends are recorded
            # Past the old engine's ids too, now that it claims no more: it served while the new one loaded,
            # and its newest requests may not be written yet.
            engine.next_request_number = max(engine.next_request_number, old.engine.next_request_number)
            old.active = False
            if old.feeds is not None:
                old.feeds.close()  # after the ends are published; frees the endpoints for the new engine's feeds
            self._console = self._launch(config, engine)
            return self._console

    def shutdown(self) -> None:
        """Stop the engine thread, mark the run stopped and flush the writer. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.api is not None:
                self.api.close()  # no new API requests reach the engine being stopped
            self._console.active = False
            self._console.engine.stop()
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


@st.cache_resource(show_spinner="Loading the model and starting the engine…", on_release=ConsoleHost.shutdown)
def get_host() -> ConsoleHost:
    """The process-wide host (created on first use, shared by every session)."""
    host = ConsoleHost.from_env()
    atexit.register(_shutdown_at_exit, weakref.ref(host))  # on_release is not guaranteed at server shutdown
    HOST_STARTED.set()
    return host


def _shutdown_at_exit(host_ref: weakref.ref[ConsoleHost]) -> None:
    host = host_ref()
    if host is not None:
        host.shutdown()
