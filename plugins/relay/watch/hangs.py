"""The hang rule: a rank stuck in compute while the others wait, a stuck checkpoint, or
every rank busy past ``hang_timeout`` at once.

:class:`~relay.watch.detection.Detector` calls :func:`find_hang` with the threshold in
force (the policy's, or one derived from the job's step times: :mod:`relay.watch.steptime`).
"""

from __future__ import annotations

import numpy as np

from relay.core.faults import Fault, FaultKind
from relay.policy.model import Detection
from relay.watch.observation import CHECKPOINT, COMPUTE, DONE, WAITING, WORKING, Observation
from relay.watch.steptime import HangLimit
from relay_train.protocol.heartbeat import Heartbeat


def _in_phase(beats: list[Heartbeat], now: float) -> dict[int, float]:
    """Return rank -> how long it has been in its phase (for a hang's evidence)."""
    return {b.rank: now - b.phase_started_at for b in beats}


def find_hang(obs: Observation, cfg: Detection, limit: HangLimit) -> Fault | None:
    """Return the hang these observations show, judged on ``limit`` (see the module)."""
    now, cols = obs.now, obs.columns  # (over the poll's columns: 8,192 ranks at 1,024 nodes)
    live = ~cols.in_phase(DONE)
    if not live.any():
        return None
    seconds = now - cols.phase_started_at  # each rank's time in its phase
    stuck = live & cols.in_phase(CHECKPOINT) & (seconds > cfg.checkpoint_timeout)
    if stuck.any():
        return _hang_fault(obs, cols.rows(stuck)[0], _in_phase(cols.rows(live), now),
                           "stuck saving a checkpoint",
                           f"checkpoint_timeout {cfg.checkpoint_timeout:g}s")
    working = live & cols.in_phase(*WORKING)
    waiting = int((working & cols.in_phase(*WAITING)).sum())
    # Only a rank whose heartbeat thread still writes is "stalled"; a silent one is left
    # to the unresponsive rules.
    alive = working & ~(now - cols.wall_clock > 3 * obs.heartbeat_interval)
    # In compute, the time its thread waited for a CPU is the host's load, not a stall.
    stalled = seconds - cols.phase_cpu_wait
    computing = alive & cols.in_phase(COMPUTE) & (stalled > limit.seconds)
    if computing.any() and waiting:
        rows = np.flatnonzero(computing)
        culprit = cols.beats[int(rows[np.argmax(stalled[rows])])]  # (the first, on a tie)
        return _hang_fault(obs, culprit, _in_phase(cols.rows(live), now), "stalled in compute "
                           f"while {waiting} rank(s) wait in the collective", limit.describe())
    # Every rank busy at once (an evaluation pass, say) is judged on the policy's own
    # hang_timeout: a threshold derived from the steps is for one rank that holds up others.
    hang_timeout = cfg.hang_timeout
    if alive.any() and (alive == live).all() and (seconds[alive] > hang_timeout).all() and all(
            r in obs.heartbeats for r in obs.expected_ranks):
        beats = cols.rows(live)
        return Fault(FaultKind.HANG, None, None,
                     {"summary": f"no rank made progress for {hang_timeout:g}s",
                      "seconds_in_phase": {r: round(s, 2)
                                           for r, s in _in_phase(beats, now).items()},
                      "steps": {b.rank: b.step for b in beats}}, obs.now)
    return None


def _hang_fault(obs: Observation, culprit: Heartbeat, in_phase: dict[int, float], what: str,
                bound: str) -> Fault:
    """Return a hang blamed on ``culprit``; ``bound`` names the threshold it passed."""
    seconds, waited = in_phase[culprit.rank], culprit.phase_cpu_wait
    of_it = f" ({waited:.1f}s of it waiting for a CPU)" if waited else ""
    return Fault(FaultKind.HANG, culprit.rank, culprit.node,
                 {"summary": f"rank {culprit.rank} {what} for {seconds:.1f}s{of_it} "
                  f"at step {culprit.step} ({bound})",
                  "phases": {b.rank: b.phase for b in obs.heartbeats.values()},
                  "seconds_in_phase": {r: round(s, 2) for r, s in in_phase.items()},
                  "step": culprit.step}, obs.now)
