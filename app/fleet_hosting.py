"""The fleet collector a console runs when asked to (opt-in), hosted like the engine: one per server process.

    fleet = get_fleet_host()     # st.cache_resource: created once, shut down on release
    fleet.watch                  # the running FleetWatch, or None
    fleet.start(pods)            # Fleet pages' form: watch these pods (replaces a running watch)
    fleet.stop()

$PREFIX_CONSOLE_FLEET_PODS (pods in `fleet.source.parse_pods` syntax, e.g.
"pod-a=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,metrics=http://10.0.0.5:8000/metrics") starts a
watch with the console. A watch is a `Collector` feeding the live `FleetIndex` and a `FleetStore` (its own
WriterProcess on the console's history database, the writer the engine's history uses too, so consoles and `python -m cli fleet watch` processes
sharing a PostgreSQL database see each other's pods); the collector scrapes the /metrics URL of the pods
that name one into both (the index keeps the recent scrapes for the live view). Without a watch the
Fleet pages read the database only. Background threads never call `st.*`; only the cached constructor
at the bottom does.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import streamlit as st

from app.hosting import get_host
from fleet.collector import Collector
from fleet.index import DEFAULT_STALE_AFTER_S, FleetIndex
from fleet.source import PodSource, parse_pods
from storage.write.fleet_sink import FleetStore
from storage.write.writer_process import WriterProcess

logger = logging.getLogger(__name__)

ENV_FLEET_PODS = "PREFIX_CONSOLE_FLEET_PODS"
ENV_FLEET_STALE_AFTER = "PREFIX_CONSOLE_FLEET_STALE_AFTER_S"  # a pod silent this long is stale (default 60)
MAX_STALE_AFTER_S = 86_400.0


@dataclass
class FleetWatch:
    """One running collector and what hangs off it."""

    pods: tuple[PodSource, ...]  # what it watches
    index: FleetIndex  # the live index (the pages' "live" view)
    writer: WriterProcess  # its own writer on the console's history database
    store: FleetStore  # the storage sink
    collector: Collector  # the subscribers, the metrics poller and the dispatcher
    started_at: float  # epoch seconds

    def close(self) -> None:
        """Stop listening, write what is queued, mark the sources closed: within about 30 s, whatever the
        database does (one that takes no rows gets its queued rows dropped, and counted)."""
        delivered = self.collector.stop(timeout_s=10)
        if delivered:  # else the dispatcher still calls the store until the writer is closed
            self.store.close()
        self.writer.close(timeout_s=10)


class FleetHost:
    """Owns the console's optional collector. Thread-safe."""

    def __init__(self, db_url: str, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> None:
        if not 0 < stale_after_s <= MAX_STALE_AFTER_S:
            raise ValueError(f"stale_after_s must be in (0, {MAX_STALE_AFTER_S:g}], got {stale_after_s}")
        self.db_url = db_url  # the console's history database (the engine host's)
        self.stale_after_s = stale_after_s  # a pod silent this long is marked stale (live and history views)
        self._lock = threading.Lock()
        self._watch: FleetWatch | None = None
        self.start_error: str | None = None  # why the last start failed (shown on the Fleet pages)

    @classmethod
    def from_env(cls, db_url: str) -> FleetHost:
        """A host configured by $PREFIX_CONSOLE_FLEET_PODS and $PREFIX_CONSOLE_FLEET_STALE_AFTER_S; a bad
        value is kept in `start_error` (shown on the pages), never raised."""
        stale_text = os.environ.get(ENV_FLEET_STALE_AFTER, "").strip()
        try:
            host = cls(db_url, float(stale_text)) if stale_text else cls(db_url)
        except ValueError as exc:
            host = cls(db_url)
            host.start_error = f"{ENV_FLEET_STALE_AFTER}: {exc}"
            return host
        text = os.environ.get(ENV_FLEET_PODS, "").strip()
        if text:
            try:
                host.start(parse_pods(text))
            except ValueError as exc:
                host.start_error = f"{ENV_FLEET_PODS}: {exc}"
        return host

    @property
    def watch(self) -> FleetWatch | None:
        with self._lock:
            return self._watch

    def start(self, pods: Sequence[PodSource]) -> FleetWatch:
        """Watch `pods` from now on (a running watch is stopped first).

        Raises:
            ValueError: no pods, or two of one name.
        """
        if not pods:
            raise ValueError("give at least one pod")
        names = [pod.name for pod in pods]
        if len(set(names)) != len(names):
            raise ValueError(f"pod names must be unique: {names}")
        with self._lock:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            writer = WriterProcess(self.db_url)
            store = FleetStore(writer)
            index = FleetIndex(stale_after_s=self.stale_after_s)
            collector = Collector(pods, [index, store])
            collector.start()
            self._watch = FleetWatch(tuple(pods), index, writer, store, collector, time.time())
            self.start_error = None
            return self._watch

    def stop(self) -> None:
        """Stop the running watch, if any."""
        with self._lock:
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def shutdown(self) -> None:
        self.stop()


@st.cache_resource(show_spinner="Starting the fleet collector…", on_release=FleetHost.shutdown)
def get_fleet_host() -> FleetHost:
    """The process-wide fleet host, on the engine host's history database."""
    host = FleetHost.from_env(get_host().db_url)
    atexit.register(_shutdown_at_exit, weakref.ref(host))
    return host


def _shutdown_at_exit(host_ref: weakref.ref[FleetHost]) -> None:
    host = host_ref()
    if host is not None:
        host.shutdown()
