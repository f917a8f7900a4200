"""Observe mode: record and notify the decision Relay would make, and leave the job alone.

A fault whose rule observes is recorded at once in the attempt folder
(``observed-NNN.json``: fault, decision, notification) and in the task state
store (``relay.recover.journal``: so the next watcher and the worker that ends the
attempt know it, whichever machine they run on), and logged to the
attempt's MLflow run when the attempt ends (``observed/NNN.json`` and the
``relay.observed`` tag); MLflow is not touched while the ranks run, since a
frozen rank may hold the tracking store's lock. The watcher then goes on
watching with that fault kind switched off for the rest of the attempt. A
crash or failed launch cannot be observed away: its processes are gone, so the
attempt ends (the task fails; no policy retry).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from relay.core.faults import Fault, FaultKind
from relay.lineage.tags import TAG_OBSERVED
from relay.policy.decide import Decision
from relay.policy.model import LoadedPolicy
from relay.policy.notify import escalate
from relay_train.protocol.heartbeat import write_atomically

log = logging.getLogger(__name__)

OBSERVED_GLOB = "observed-*.json"
# Faults whose processes are already gone: observing them cannot keep the job running.
ENDS_ATTEMPT = frozenset({FaultKind.CRASH, FaultKind.LAUNCH_FAILURE, FaultKind.SHORT_SEGMENT})


def record_observation(attempt_dir: Path, fault: Fault, decision: Decision,
                       policy: LoadedPolicy, message: str) -> dict[str, Any]:
    """Notify, then write the observation next to the attempt's logs; return the record."""
    delivery = escalate(decision.notify or policy.policy.escalation.target, message,
                        policy.policy.escalation, {"decision": decision.to_dict(),
                                                   "mode": "observe"})
    number = len(list(attempt_dir.glob(OBSERVED_GLOB))) + 1
    record = {"fault": fault.to_event()["fault"], "decision": decision.to_dict(),
              "mode": "observe", "notification": delivery.to_dict(),
              "policy_file": str(policy.path)}
    write_atomically(attempt_dir / f"observed-{number:03d}.json",
                     json.dumps(record, indent=2, default=str), durable=True)
    log.warning("%s (recorded in %s)", message, attempt_dir / f"observed-{number:03d}.json")
    return record


def observations(attempt_dir: Path,
                 stored: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Return the attempt's observation records, oldest first: ``stored`` (what the task
    state store keeps, seen by every worker) and this machine's files it lacks."""
    found = list(stored or [])
    known = {json.dumps(r.get("fault"), sort_keys=True, default=str) for r in found}
    for path in sorted(attempt_dir.glob(OBSERVED_GLOB)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("Unreadable observation %s; skipped", path)
            continue
        if json.dumps(record.get("fault"), sort_keys=True, default=str) not in known:
            found.append(record)
    return found


def watched_kinds(attempt_dir: Path, stored: list[dict[str, Any]] | None = None) -> list[str]:
    """Return the fault kinds still watched: all but those observed in this attempt."""
    seen = {r["fault"]["kind"] for r in observations(attempt_dir, stored) if "fault" in r}
    return [k.value for k in FaultKind if k.value not in seen or k in ENDS_ATTEMPT]


def log_observations(lineage: Any, run_id: str, attempt_dir: Path,  # noqa: ANN401
                     stored: list[dict[str, Any]] | None = None) -> None:
    """Log the attempt's observations to its MLflow run (when the attempt has ended)."""
    records = observations(attempt_dir, stored)
    for number, record in enumerate(records, start=1):
        lineage.log_json(run_id, f"observed/{number:03d}.json", record)
    if records:
        lineage.set_tags(run_id, {TAG_OBSERVED: ",".join(r["fault"]["kind"] for r in records)})
