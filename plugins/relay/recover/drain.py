"""Drain: have the ranks checkpoint a few steps ahead and stop (before a migration).

Kept free of Airflow imports: the warden (:mod:`relay.recover.warden`) drains too, in the
triggerer's environment, where Airflow's metadata database is off limits.
"""

from __future__ import annotations

import logging
import math
import time

from relay.core.attempt import Attempt, AttemptState
from relay.launchers import Launcher, launcher_from
from relay_train.protocol.heartbeat import Heartbeat, Phase
from relay_train.protocol.routes import STOP_AT, Route

log = logging.getLogger(__name__)
DRAIN_LEAD_STEPS = 2
# How far the ranks may be past the newest heartbeat read when the request reaches them: a
# record up to a heartbeat interval old (a second through Slurm's channel), and the way
# there. Unpaced ranks at 15 steps/s were past a 2-step lead in one of two drains on Slurm.
DRAIN_LEAD_SECONDS = 1.5
RATE_SAMPLE_SECONDS = 0.3  # between the two reads the step rate is measured from
POLL_SECONDS = 0.1


def done(before: dict[int, Heartbeat], now: dict[int, Heartbeat]) -> bool:
    """Return whether every rank of ``before`` now says it is done. A rank says so once it
    has published its checkpoints (:meth:`relay_train.api.Session.close`), so the drained
    checkpoint is complete then; waiting for the processes to exit as well (0.5-1 s here:
    tearing down the process group and the interpreter) would only delay the stop that
    ends them anyway."""
    return all(r in now and now[r].phase == Phase.DONE.value for r in before)


def step_rate(before: dict[int, Heartbeat], after: dict[int, Heartbeat]) -> float:
    """Return the fastest rank's steps a second between two reads of the heartbeats, by
    each rank's own clock (its records' ``wall_clock``: no skew between nodes); 0 when no
    rank's record moved on."""
    rates = [(b.step - a.step) / (b.wall_clock - a.wall_clock)
             for r, b in after.items() if (a := before.get(r)) is not None
             and b.step > a.step and b.wall_clock > a.wall_clock]
    return max(rates, default=0.0)


def drain_target(beats: dict[int, Heartbeat], end_step: int | None, rate: float = 0.0) -> int:
    """Return the step to drain to: :data:`DRAIN_LEAD_STEPS` past the furthest rank, plus
    the steps it makes at ``rate`` (steps/s) in :data:`DRAIN_LEAD_SECONDS`, but never past
    the segment's end (the ranks stop and checkpoint there anyway: a target past it names a
    step no checkpoint will have)."""
    target = max(b.step for b in beats.values()) + DRAIN_LEAD_STEPS + math.ceil(
        max(rate, 0.0) * DRAIN_LEAD_SECONDS)
    return target if end_step is None else min(target, end_step)


def drain(
    attempt: Attempt, timeout_seconds: float, launcher: Launcher | None = None,
    end_step: int | None = None,
) -> int | None:
    """Ask the ranks to checkpoint and stop a few steps ahead (at most at ``end_step``, the
    segment's end); return the step, if they did.

    The request goes to every node's agent over the channel; an agent that does not take
    it (unreachable, or serving another attempt) leaves the drain to time out.
    """
    launcher = launcher or launcher_from(None)
    first = launcher.status(attempt).heartbeats
    if not first:
        return None
    time.sleep(RATE_SAMPLE_SECONDS)
    beats = launcher.status(attempt).heartbeats or first
    stop_at = drain_target(beats, end_step, step_rate(first, beats))
    channel = launcher.channel(attempt)
    taken = [n for n in channel.addresses if channel.ask(n, Route.DRAIN, **{STOP_AT: stop_at})]
    if len(taken) < len(channel.addresses):
        log.warning("Drain to step %d reached only %s of %s", stop_at, taken,
                    sorted(channel.addresses))
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        status = launcher.status(attempt)
        if status.state is AttemptState.COMPLETED or done(beats, status.heartbeats):
            log.info("Ranks checkpointed at step %d and stopped", stop_at)
            return stop_at
        if status.state is AttemptState.FAILED:
            break
        time.sleep(POLL_SECONDS)
    log.warning("Drain to step %d did not finish in %.0fs; the retry resumes from the last "
                "checkpoint instead", stop_at, timeout_seconds)
    return None
