"""A DAG run's orchestrator lease: what Relay keeps warm for a run leaves once nobody renews it.

Relay's side (preflight, each segment's launch, its watcher's polls, a recovery that
decides to retry) renews the lease in the DAG run's folder: ``orchestrator.lease``, the
epoch second it holds until. The processes that outlive an attempt on a local host (a
run's resident agent, an agent lingering after its ranks ended) read it: a lease that has
lapsed means the run's orchestrator (its Airflow task, its triggerer) is gone, killed or
finished without ending the run, and they leave instead of waiting out their own idle
timeouts. A run folder with no lease (one from before this file existed) changes nothing.
Stdlib only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from relay_train.protocol.heartbeat import write_atomically

LEASE_FILE = "orchestrator.lease"  # in a DAG run's folder
# The lease a renewal grants: longer than any gap between two renewals of a live run (a
# watcher renews every poll; a recovery's drain takes up to checkpoint_timeout, and a retry's
# backoff is added to its renewal), short enough that a dead run's agents soon leave.
RUN_LEASE_SECONDS = 180.0
UNTIL = "until"


def renew(run_dir: Path, seconds: float = RUN_LEASE_SECONDS, by: str = "") -> bool:
    """Hold the run's lease ``seconds`` from now (never shortening it); return whether it
    was written (not where the run's folder is not on this machine)."""
    if not run_dir.is_dir():
        return False
    until = time.time() + seconds
    held = held_until(run_dir)
    if held is not None and held > until:
        return True
    try:
        write_atomically(run_dir / LEASE_FILE, json.dumps({UNTIL: until, "by": by,
                                                           "pid": os.getpid()}))
    except OSError:
        return False
    return True


def held_until(run_dir: Path) -> float | None:
    """Return when the run's lease ends (None: never leased, or unreadable)."""
    try:
        until = json.loads((run_dir / LEASE_FILE).read_text())[UNTIL]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(until) if isinstance(until, int | float) else None


def attempt_lapsed(attempt_dir: Path) -> bool:
    """Return whether the lease of the run an attempt folder (``<run>/segment-NNN/try-N``)
    belongs to has lapsed (False for a folder not in a run's)."""
    parents = attempt_dir.parents
    return len(parents) > 1 and lapsed(parents[1])


def lapsed(run_dir: Path, now: float | None = None) -> bool:
    """Return whether the run was leased and nobody renewed it in time."""
    until = held_until(run_dir)
    return until is not None and (time.time() if now is None else now) > until
