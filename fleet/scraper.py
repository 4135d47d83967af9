"""The collector's metrics thread: every pod that names a /metrics URL is scraped every `metrics_every_s`.

Each scrape becomes a `fleet.events.PodMetrics` record (values, or the error) queued for the sinks like
the pods' batches, so the index keeps the recent ones for the live view and the storage sink writes
them to the history (the console's History view then shows KV usage and hit rates too).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from fleet.config import CollectorConfig
from fleet.metrics import MetricsError, failed_scrape, pod_metrics, scrape
from fleet.source import PodSource

logger = logging.getLogger(__name__)


class MetricsPoller:
    """Scrapes the pods' /metrics on one thread and queues each result for the sinks."""

    def __init__(
        self,
        sources: Sequence[PodSource],
        config: CollectorConfig,
        emit: Callable[[object, int], None],
        stop: threading.Event,
    ) -> None:
        """Args:
        sources: the pods (those without a metrics URL are skipped).
        config: metrics_every_s, metrics_timeout_s, poll_interval_s.
        emit: queues a record for the sinks (raises queue.Full when there is no room yet).
        stop: set when the collector stops.
        """
        self.urls = {source.name: source.metrics_url for source in sources if source.metrics_url is not None}
        self._config = config
        self._emit = emit
        self._stop = stop

    def run(self) -> None:
        while True:
            for name, url in self.urls.items():
                try:
                    record = pod_metrics(name, scrape(url, timeout_s=self._config.metrics_timeout_s))
                except MetricsError as error:
                    logger.debug("pod %s: %s", name, error)
                    record = failed_scrape(name, time.time(), str(error))
                if not self._put(record):
                    return
            if self._stop.wait(self._config.metrics_every_s):
                return

    def _put(self, record: object) -> bool:
        """Queue a record, waiting for room; False if the collector stopped meanwhile."""
        while not self._stop.is_set():
            try:
                self._emit(record, 0)
                return True
            except queue.Full:
                continue
        return False
