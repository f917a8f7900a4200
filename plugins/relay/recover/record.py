"""Record a decision: in the attempt folder first, then in MLflow, which never undoes it.

The decision is already made and applied when it is recorded; ``decision.json``
in the attempt's folder (fsynced) is written first, for whoever is on call.
Lineage retries each MLflow call within a bound; what still fails is logged
once here and dropped, so a short tracking-store outage never turns the
policy's decision into Airflow's default retry.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from relay.core.attempt import AttemptState
from relay.core.faults import Fault
from relay.lineage import traces
from relay.lineage.tags import (
    TAG_CULPRIT_NODE,
    TAG_CULPRIT_RANK,
    TAG_DECISION,
    TAG_FAULT,
    TAG_LOST_STEPS,
    TAG_POLICY_SHA256,
    TAG_RULE,
)
from relay.policy.decide import Decision
from relay.policy.observe import log_observations
from relay.recover.evidence import Evidence, attach_evidence
from relay_train.protocol.heartbeat import write_atomically

if TYPE_CHECKING:
    from relay.lineage.resume_time import ResumeClock
    from relay_train.protocol.launch import LaunchConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


def best_effort(what: str, work: Callable[[], T]) -> T | None:
    """Run an MLflow call whose failure must not undo a decision; None if it failed."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - logged once and dropped, by design
        log.error("Could not %s in MLflow after retries (%s: %s); dropped. The decision "
                  "stands and its record is in the attempt folder.", what,
                  type(exc).__name__, exc)
        return None


def record_fault(lineage: Any, run_id: str, attempt_dir: Path,  # noqa: ANN401
                 record: Mapping[str, Any], tags: Mapping[str, str],
                 observed: list[dict[str, Any]] | None = None) -> None:
    """Log the attempt's observations (``observed``: those the task state store keeps),
    fault and decision, and close its run as a fault."""
    best_effort("log the observations",
                lambda: log_observations(lineage, run_id, attempt_dir, observed))
    best_effort("log fault.json", lambda: lineage.log_json(run_id, "fault.json", record["fault"]))
    best_effort("log decision.json", lambda: lineage.log_json(run_id, "decision.json", record))
    best_effort("close the attempt run",
                lambda: lineage.finish_run(run_id, AttemptState.RECORDED, tags))


def fault_message(segment: int, fault: Fault, decision: Decision, lost: int | None) -> str:
    """Return the task log's and the escalation's one message about a fault."""
    lost_text = "unknown" if lost is None else str(lost)
    return (
        f"Segment {segment} fault: {fault.describe()} "
        f"(evidence: {json.dumps(fault.evidence, default=str)}). "
        f"Decision by {decision.rule} (policy sha256 {decision.policy_sha256[:12]}): "
        f"{decision.action} - {decision.reason}. Lost steps: {lost_text}."
    )


def fault_tags(fault: Fault, decision: Decision, **extra: str) -> dict[str, str]:
    """Return the MLflow tags of an attempt run that ended in ``fault``."""
    return {TAG_FAULT: fault.kind.value, TAG_DECISION: decision.action,
            TAG_RULE: decision.rule, TAG_POLICY_SHA256: decision.policy_sha256,
            TAG_CULPRIT_NODE: str(fault.culprit_node),
            TAG_CULPRIT_RANK: str(fault.culprit_rank), **extra}


def write_decision(folder: Path, entry: Mapping[str, Any]) -> None:
    """Write ``decision.json`` in the attempt's folder (fsynced: it counts the fault)."""
    write_atomically(folder / "decision.json", json.dumps(entry, indent=2, default=str),
                     durable=True)


def record_decision(entry: dict[str, Any], folder: Path, cfg: LaunchConfig,
                    lineage: Any, fault: Fault, decision: Decision,  # noqa: ANN401
                    evidence: Evidence | None, clock: ResumeClock,
                    observed: list[dict[str, Any]] | None) -> None:
    """Write the decision next to the attempt's logs (for whoever is on call) and in
    MLflow (for the record), then again with the record step's time in its breakdown."""
    if evidence is not None:  # into fault.json only: the task log's message stays one line
        attach_evidence(entry["fault"], evidence, lineage, cfg.run_id)
    write_decision(folder, entry)
    record_fault(lineage, cfg.run_id, folder, entry, fault_tags(
        fault, decision, **{TAG_LOST_STEPS: str(entry["lost_steps"])}), observed)
    clock.mark("record", time.time())  # the retry's task completes the breakdown
    entry["time_to_resume"] = clock.to_dict()
    write_decision(folder, entry)
    traces.emit_recovery(folder, entry, traces.DECISION_PARTS, background=True)  # the rest: the
    # retry's task (resume_time.finish_previous)
