"""What the collector feeds: anything that takes a pod's batches in order.

The collector calls a sink from one thread only (its dispatcher), per pod in sequence order:
`open_pod` once before anything of that pod, then `apply_batch` for each batch and `reset_pod` when
the pod's state is void (a restarted server). A sink never sees a batch twice, never a batch that
failed to decode, and never a pod's batches out of order. Batches of different pods interleave, and
with them each pod's `pod_status` (its link, when it changes and as a heartbeat) and `apply_metrics`
(a scrape of its /metrics, for pods that name one).

`fleet.index.FleetIndex` is one sink. Phase B's storage writer is another (fleet sources, stored and
removed events, block lifetimes, the eviction log), and so is a publisher that re-emits the feed.
"""

from __future__ import annotations

from typing import Protocol

from fleet.events import PodBatch, PodMetrics, PodReset, PodStatus
from fleet.source import PodSource


class BatchSink(Protocol):
    """Receives every pod's decoded batches."""

    def open_pod(self, source: PodSource, at: float) -> None:
        """A pod is watched from `at` (wall clock) on; called once per pod, before its batches."""

    def apply_batch(self, batch: PodBatch) -> None:
        """Apply one batch; raising counts a sink error and does not stop the collector."""

    def reset_pod(self, reset: PodReset) -> None:
        """Drop everything known about the pod's cache: the batches that follow start from empty."""

    def pod_status(self, status: PodStatus) -> None:
        """The collector's link to the pod, and its counts of lost batches and restarts."""

    def apply_metrics(self, metrics: PodMetrics) -> None:
        """One scrape of the pod's /metrics (or why it failed)."""
