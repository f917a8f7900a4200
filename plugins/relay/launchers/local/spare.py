"""A spare node's agent, warmed at the first sign that a node stopped answering.

A retry after a frozen node runs on a node the faulty attempt did not use, and
that node's agent has to import the training stack first (seconds of CPU). The
standby Relay starts when it decides (see :mod:`relay_train.agent.standby`) begins
that work only once the fault is confirmed (``heartbeat_timeout``). The watcher
starts it sooner, at the first sign of a fault that moves the job off a node:
a node's agent, heard before, missing a poll its peers answer; a rank in compute
past half the hang threshold while another waits; a rank half way to being
called a straggler (:meth:`relay.watch.detection.Detector.suspects`). It
warms a standby on the node a retry would take (the first free node of the pool
when the segment was watched). The retry
claims it like any standby; if no retry comes, or the retry is given other nodes,
the standby leaves by itself after ``ttl``. At most one live standby at a time
(:class:`Warmer`): a slow answer or a passing slowness under load costs one preload
per ``ttl``, not one per poll, and a sign that proved false does not leave the real
fault, a minute later, without its spare.

No Airflow import: the trigger runs it in the triggerer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from relay.launchers.base import LaunchStatus

log = logging.getLogger(__name__)


def plan(directory: Path, free: list[str], ttl_seconds: float) -> dict[str, Any] | None:
    """Return the trigger's argument: warm ``free[0]`` in ``directory`` (None: no free node)."""
    if not free:
        return None
    return {"directory": str(directory), "node": free[0], "ttl": ttl_seconds}


def silent_nodes(status: LaunchStatus | None, after: float) -> list[str]:
    """Return the nodes whose agents answered once, but not in the ``after`` seconds before
    the latest answer of another node (not before now: a poll waits out a silent agent, so
    every answer of that poll is already that old). The watcher passes its poll interval:
    answers to one poll arrive together, a frozen node's trails by a whole poll, and the
    fault is called about two polls later, each waiting out the silent agent."""
    if status is None:
        return []
    heard = {n: s.last_seen for n, s in status.nodes.items() if s.last_seen is not None}
    newest = max(heard.values(), default=0.0)
    return sorted(n for n, t in heard.items() if newest - t >= after)


def warm(spare: dict[str, Any], launcher: Any, why: str) -> None:  # noqa: ANN401
    """Start the planned standby (a blocking call: run it off the event loop)."""
    log.warning("%s: warming a standby on %s for a retry", why, spare["node"])
    launcher.prestart(Path(spare["directory"]), [spare["node"]], float(spare["ttl"]))


class Warmer:
    """Warm the planned spare at a sign of a fault: again only once the last one's ``ttl``
    has run out (it left by itself), never while it may still be waiting."""

    def __init__(self, spare: dict[str, Any] | None, launcher: Any) -> None:  # noqa: ANN401
        self.spare = spare
        self.launcher = launcher
        self.warmed_at: float | None = None  # time.monotonic() of the last warm-up

    def due(self, now: float) -> bool:
        """Return whether a sign now would warm the spare."""
        if self.spare is None:
            return False
        return self.warmed_at is None or now - self.warmed_at > float(self.spare["ttl"]) + 1.0

    async def sign(self, why: str | None) -> None:
        """Warm the spare off the event loop if ``why`` says a fault is on its way."""
        now = time.monotonic()
        if why and self.due(now):
            self.warmed_at = now
            await asyncio.to_thread(warm, self.spare, self.launcher, why)
