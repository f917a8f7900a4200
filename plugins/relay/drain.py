"""Drain: have the ranks checkpoint a few steps ahead and stop (before a migration).

Kept free of Airflow imports: the warden (:mod:`relay.unattended`) drains too, in the
triggerer's environment, where Airflow's metadata database is off limits.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from relay.launchers import Launcher, LaunchState, launcher_from
from relay_train.heartbeat import read_heartbeats, write_atomically
from relay_train.launch import DRAIN_FILE

log = logging.getLogger(__name__)
DRAIN_LEAD_STEPS = 2


def drain(
    attempt_dir: Path, timeout_seconds: float, launcher: Launcher | None = None
) -> int | None:
    """Ask the ranks to checkpoint and stop a few steps ahead; return the step, if they did."""
    beats = read_heartbeats(attempt_dir / "heartbeats")
    if not beats:
        return None
    stop_at = max(b.step for b in beats.values()) + DRAIN_LEAD_STEPS
    write_atomically(attempt_dir / DRAIN_FILE, json.dumps({"stop_at": stop_at}))
    launcher = launcher or launcher_from(None)
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        state = launcher.status(attempt_dir).state
        if state is LaunchState.SUCCEEDED:
            log.info("Ranks checkpointed at step %d and stopped", stop_at)
            return stop_at
        if state is LaunchState.FAILED:
            break
        time.sleep(0.2)
    log.warning("Drain to step %d did not finish in %.0fs; the retry resumes from the last "
                "checkpoint instead", stop_at, timeout_seconds)
    return None
