"""A preemption notice: the platform takes a healthy node back, after a grace period.

Kubernetes evicts a pod with SIGTERM and kills it ``terminationGracePeriodSeconds``
later; Slurm's ``--signal=TERM@N`` (or ``scancel --signal=TERM``) warns a job step
before its end; a spot reclaim gives a warning of its own. The node agent receives
the SIGTERM. Relay's own stop never starts with one: every launcher asks over the
channel first (:data:`relay_train.protocol.routes.Route.STOP`), and where Relay shares
the attempt folder with the agents (the local launcher) it also marks its stop there
(:data:`relay_train.protocol.launch.STOP_FILE`) before signalling, so an ask that came
late or never (a frozen or loaded agent) still makes the SIGTERM a stop. A SIGTERM to
an agent whose ranks run, that Relay neither asked nor marked, is a notice. (On a
cluster the mark cannot reach the node's disk: an agent that missed the ask reads its
SIGTERM as a notice, and Relay's stop ends it after the stop's own grace: Slurm's
``scancel -s KILL``, or its pod deleted again with that grace.)

The agent then keeps its ranks training and says so on its channel
(:data:`~relay_train.protocol.routes.PREEMPTED`: the grace and the notice's age), so
that Relay drains every node of the attempt to a checkpoint within the grace and
retries elsewhere. If no stop comes, the agent stops its ranks itself in time for
their own SIGTERM-to-SIGKILL grace to end before the platform's, and exits with
:data:`~relay_train.protocol.launch.PREEMPTED_EXIT`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from relay_train.agent.ranks import TERM_GRACE_SECONDS
from relay_train.protocol.env import ENV_PREEMPT_GRACE
from relay_train.protocol.launch import STOP_FILE
from relay_train.protocol.routes import (
    AGE_SECONDS,
    DEFAULT_PREEMPT_GRACE_SECONDS,
    DRAIN_SECONDS,
    GRACE_SECONDS,
)

log = logging.getLogger("relay_train.agent.notice")

# The agent's own stop of its ranks leaves this long before the platform's SIGKILL: their
# SIGTERM-to-SIGKILL grace, and a second to exit.
STOP_MARGIN_SECONDS = TERM_GRACE_SECONDS + 1.0


def grace_from_env() -> float:
    """Return the platform's grace (``$RELAY_PREEMPT_GRACE_SECONDS``, else the default)."""
    raw = os.environ.get(ENV_PREEMPT_GRACE, "").strip()
    if not raw:
        return DEFAULT_PREEMPT_GRACE_SECONDS
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace >= 0:  # NaN too
        log.error("$%s: expected the platform's grace period in seconds (e.g. 30), found "
                  "%r; assuming %gs", ENV_PREEMPT_GRACE, raw, DEFAULT_PREEMPT_GRACE_SECONDS)
        return DEFAULT_PREEMPT_GRACE_SECONDS
    return grace


@dataclass
class Notice:
    """A preemption notice received (by a signal handler: it only records the time)."""

    grace_seconds: float
    received: float = field(default_factory=time.monotonic)
    logged: bool = False

    @property
    def drain_seconds(self) -> float:
        """Return how long after the notice the ranks may train (then the agent stops them)."""
        return max(self.grace_seconds - STOP_MARGIN_SECONDS, 0.0)

    def age(self) -> float:
        """Return the seconds since the notice came."""
        return time.monotonic() - self.received

    def due(self) -> bool:
        """Return whether the agent must stop its ranks now to beat the platform's SIGKILL
        (logging the notice the first time: the signal handler that made it cannot)."""
        if not self.logged:
            self.logged = True
            log.warning("preemption notice (SIGTERM): the ranks train on; Relay has %gs to "
                        "drain them to a checkpoint", self.grace_seconds)
        if self.age() < self.drain_seconds:
            return False
        log.warning("preemption notice %.1fs ago and no stop from Relay: stopping the ranks "
                    "before the platform's grace (%gs) ends", self.age(), self.grace_seconds)
        return True

    def expired(self) -> bool:
        """Return whether the grace is over (the platform's SIGKILL is due)."""
        return self.age() >= self.grace_seconds

    def record(self) -> dict[str, float]:
        """Return the channel's :data:`~relay_train.protocol.routes.PREEMPTED` field."""
        return {GRACE_SECONDS: self.grace_seconds, DRAIN_SECONDS: self.drain_seconds,
                AGE_SECONDS: round(self.age(), 3)}


def notice_of_sigterm(attempt_dir: Path, grace_seconds: float) -> Notice | None:
    """Return the notice a SIGTERM is, or None when Relay marked it its own stop
    (:data:`~relay_train.protocol.launch.STOP_FILE` in the attempt folder). Safe in a
    signal handler: one ``stat``, no lock, nothing logged."""
    if (attempt_dir / STOP_FILE).exists():
        return None
    return Notice(grace_seconds)
