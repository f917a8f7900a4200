"""A spare node's agent, planned for each watch of the local launcher's attempts.

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
takes it like any standby; if no retry comes, or the retry is given other nodes,
the standby leaves by itself after ``ttl``. At most one live standby at a time
(:class:`Warmer`): a slow answer or a passing slowness under load costs one preload
per ``ttl``, not one per poll, and a sign that proved false does not leave the real
fault, a minute later, without its spare.

No Airflow import: the trigger runs it in the triggerer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plan(directory: Path, free: list[str], ttl_seconds: float) -> dict[str, Any] | None:
    """Return the trigger's argument: warm ``free[0]`` in ``directory`` (None: no free node)."""
    if not free:
        return None
    return {"directory": str(directory), "node": free[0], "ttl": ttl_seconds}
