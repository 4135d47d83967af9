"""A pod's health: silence and a dead link are different things.

A pod that sends nothing may simply be idle (no requests: its cache stands as last seen) or gone (its
server died, or nothing ever listened at its endpoint). The collector's socket monitor tells them apart
(`fleet.events.LinkState`); the index, given the link by `PodStatus` records, classifies:

    link REFUSED                          UNREACHABLE  nothing listens at the PUB endpoint
    link DISCONNECTED                     DOWN         the server went away (a restart comes back as a reset)
    a batch within stale_after_s          LIVE
    link CONNECTED, silent for longer     IDLE         not stale: its cache is as last seen
    link CONNECTING, silent for longer    UNREACHABLE  no connection was ever made
    no link known, silent for longer      SILENT       (an index fed without a collector's statuses)

A pod is stale, its blocks possibly out of date, when it is UNREACHABLE, DOWN or SILENT.
"""

from __future__ import annotations

import enum

from fleet.events import LinkState


class PodHealth(enum.Enum):
    """What the console says about a pod's feed."""

    LIVE = "live"  # batches arrive
    IDLE = "idle"  # connected and quiet
    DOWN = "down"  # the connection was lost
    UNREACHABLE = "unreachable"  # nothing listens at its endpoint
    SILENT = "silent"  # quiet, and no link state known

    @property
    def stale(self) -> bool:
        """Whether the pod's blocks may be out of date (shown, never dropped)."""
        return self in (PodHealth.DOWN, PodHealth.UNREACHABLE, PodHealth.SILENT)


def pod_health(link: LinkState | None, seconds_silent: float, stale_after_s: float) -> PodHealth:
    """Classify a pod (see the module docstring).

    Args:
        link: the latest link state the collector reported; None when none was.
        seconds_silent: since the pod's last batch (or since it was opened).
        stale_after_s: the silence after which a pod without a connected link is stale.
    """
    if link is LinkState.REFUSED:
        return PodHealth.UNREACHABLE
    if link is LinkState.DISCONNECTED:
        return PodHealth.DOWN
    if seconds_silent <= stale_after_s:
        return PodHealth.LIVE
    if link is LinkState.CONNECTED:
        return PodHealth.IDLE
    if link is LinkState.CONNECTING:
        return PodHealth.UNREACHABLE
    return PodHealth.SILENT
