"""Warm a spare at the first sign of a fault, before the fault is called.

A retry after a frozen node runs on a node the faulty attempt did not use, and
that node's agent has to import the training stack first (seconds of CPU). A
launcher with :class:`~relay.launchers.base.Continuity` plans a spare for each
watch (:meth:`~relay.launchers.base.Continuity.plan_spare`: a standby on the
first free node of the pool); the watcher warms it at the first sign of a fault
that moves the job off a node: a node's agent, heard before, missing a poll its
peers answer (:func:`silent_nodes`); a rank in compute past half the hang
threshold while another waits; a rank half way to being called a straggler
(:meth:`relay.watch.detection.Detector.suspects`). The retry takes it like any
standby; if no retry comes, or the retry is given other nodes, it leaves by
itself after ``ttl``. At most one live spare at a time (:class:`Warmer`): a slow
answer or a passing slowness under load costs one preload per ``ttl``, not one
per poll, and a sign that proved false does not leave the real fault, a minute
later, without its spare.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from relay.launchers.base import LaunchStatus


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


class Warmer:
    """Warm the planned spare at a sign of a fault: again only once the last one's ``ttl``
    has run out (it left by itself), never while it may still be waiting."""

    def __init__(self, spare: dict[str, Any] | None, launcher: Any) -> None:  # noqa: ANN401
        self.spare = spare
        self.launcher = launcher
        self.warmed_at: float | None = None  # time.monotonic() of the last warm-up

    def due(self, now: float) -> bool:
        """Return whether a sign now would warm the spare."""
        if self.spare is None or self.launcher.continuity is None:
            return False
        return self.warmed_at is None or now - self.warmed_at > float(self.spare["ttl"]) + 1.0

    async def sign(self, why: str | None) -> None:
        """Warm the spare off the event loop if ``why`` says a fault is on its way."""
        now = time.monotonic()
        if why and self.due(now):
            self.warmed_at = now
            await asyncio.to_thread(self.launcher.continuity.warm_spare, self.spare, why)
