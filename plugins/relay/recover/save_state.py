"""Save what can be saved before a faulty attempt is stopped: stacks, a drain or a rescue.

While the ranks still answer, the pipeline asks every rank for its stacks and
collective trace (where is it stuck?), and, as the decision says, either has
the ranks drain to a checkpoint a few steps ahead (``checkpoint_and_migrate``;
after a preemption notice, within what is left of its grace) or has a healthy
rank hand over its in-memory state (a rescue, after a hang or
a lost rank or node). Whoever acts, the segment task or its warden, saves the
same way; a task that finds the warden already did uses what it saved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.core.attempt import Attempt
from relay.core.faults import RESCUABLE, Fault, FaultKind
from relay.launchers import Launcher
from relay.recover.ask_rescue import request_rescue
from relay.recover.drain import drain
from relay.recover.evidence import (
    RECEIVED_DIR,
    Evidence,
    EvidenceRequest,
    ask_for_evidence,
    collect_evidence,
    kept_evidence,
)
from relay.recover.warden_record import Stopped
from relay_train.protocol.manifest import file_sha256
from relay_train.protocol.rescue_files import RescueResult

if TYPE_CHECKING:
    from relay.policy.decide import Decision
    from relay_train.protocol.launch import LaunchConfig

log = logging.getLogger(__name__)

# What is saved before the stop, as the decision's rule says.
RESCUE, DRAIN, STOP = "rescue", "drain", "stop"
MIN_DRAIN_SECONDS = 1.0  # less of a notice's grace left: no drain is tried


def save_step(decision: Decision, kind: FaultKind) -> str:
    """Return what to save before stopping an attempt ``decision`` is about."""
    if decision.checkpoint_first:
        return DRAIN
    if decision.retry and not decision.rollback and kind in RESCUABLE:
        return RESCUE
    return STOP


@dataclass
class Saved:
    """What was saved from an attempt before its stop."""

    evidence: Evidence | None = None
    drained_at: int | None = None  # the step the ranks drained to
    rescued: RescueResult | None = None  # a healthy rank's in-memory state
    asked: EvidenceRequest | None = None  # the stacks asked for (their answers are on disk)
    note: str | None = None  # why nothing was drained although the decision said to


def save_state(attempt: Attempt, cfg: LaunchConfig, fault: Fault, step: str,
               timeouts: dict[str, float], launcher: Launcher) -> Saved:
    """Ask for stacks, then drain or rescue as ``step`` says; return what came back.

    ``timeouts``: ``checkpoint_timeout`` (drain, rescue) and ``evidence_timeout``.
    Whatever goes wrong saving is logged, never raised: the stop that follows is the
    point, and the retry resumes from the latest checkpoint.
    """
    saved = Saved()
    try:
        saved.asked = ask_for_evidence(attempt, fault, cfg, launcher)
        if step == DRAIN:
            window, saved.note = drain_window(fault, timeouts["checkpoint_timeout"], time.time())
            if window > 0:
                saved.drained_at = drain(attempt, window, launcher, cfg.end_step)
            if saved.drained_at is None and fault.kind is FaultKind.PREEMPTED:
                saved.note = saved.note or (
                    f"the ranks did not drain within the notice's grace (the {window:.1f}s "
                    "left of it); the retry resumes from the latest valid checkpoint")
            if saved.note:
                log.warning("%s", saved.note)
        elif step == RESCUE:
            saved.rescued = request_rescue(attempt, cfg, fault, timeouts["checkpoint_timeout"],
                                           launcher)
        if saved.asked is not None:
            saved.evidence = collect_evidence(saved.asked, timeouts["evidence_timeout"])
    except Exception:  # noqa: BLE001 - logged; the retry resumes from the last checkpoint
        log.exception("Could not save the state of %s before stopping it", attempt)
    return saved


def drain_window(fault: Fault, timeout: float, now: float) -> tuple[float, str | None]:
    """Return how long a drain may take (``timeout``, or what is left of a preemption
    notice's grace, if less) and, when nothing is left, why no drain is tried."""
    drain_by = fault.evidence.get("drain_by") if fault.kind is FaultKind.PREEMPTED else None
    if not isinstance(drain_by, int | float):
        return timeout, None
    left = drain_by - now
    if left >= MIN_DRAIN_SECONDS:
        return min(timeout, left), None
    return 0.0, (f"the preemption notice's grace ({fault.evidence.get('grace_seconds')}s) left "
                 f"{max(left, 0.0):.1f}s, too short to drain; the retry resumes from the latest "
                 "valid checkpoint")


def from_warden(stopped: Stopped, decision: Decision, fault: Fault,
                attempt_dir: Path) -> Saved:
    """Return what the warden saved, as far as ``decision`` wants it.

    The rescue counts only where the decision would have asked for it, and only if its
    file still matches the sha256 the rank reported.
    """
    log.warning("The workload was stopped by its warden %.1fs after the fault was detected "
                "(no one resumed the task sooner); using what it saved",
                stopped.stopped_at - stopped.detected_at)
    saved = Saved()
    if stopped.evidence_request is not None:  # the agents are gone now: read what came
        saved.evidence = kept_evidence(attempt_dir / RECEIVED_DIR,
                                       list(stopped.evidence_request["ranks"]))
    step = save_step(decision, fault.kind)
    saved.drained_at = stopped.drained_at if step == DRAIN else None
    if stopped.rescued is not None and step == RESCUE:
        candidate = RescueResult(**stopped.rescued)
        if candidate.path and file_sha256(Path(candidate.path)) == candidate.sha256:
            saved.rescued = candidate
        else:
            log.warning("The rescued state %s no longer matches its sha256; not used",
                        candidate.path)
    return saved


def as_record(saved: Saved) -> dict[str, Any]:
    """Return the warden's fields for what it saved (:class:`Stopped`)."""
    from dataclasses import asdict

    return {"rescued": None if saved.rescued is None else asdict(saved.rescued),
            "drained_at": saved.drained_at,
            "evidence_request": None if saved.asked is None else {
                "id": saved.asked.request_id, "ranks": saved.asked.ranks}}
