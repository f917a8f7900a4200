"""Record a decision: in the attempt folder first, then in MLflow, which never undoes it.

The decision is already made and applied when it is recorded; ``decision.json``
in the attempt's folder (fsynced) is written first, for whoever is on call.
Lineage retries each MLflow call within a bound; what still fails is logged
once here and dropped, so a short tracking-store outage never turns the
policy's decision into Airflow's default retry.
"""

from __future__ import annotations

import dataclasses
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


LINE_LIMIT = 200  # the decision line: short enough to read whole in Airflow's log view
NAME_LIMITS = (24, 12)  # node and rule names shown up to this long, shorter if still too long


def _short(name: object, limit: int) -> str:
    text = str(name)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def decision_line(segment: int, fault: Fault, decision: Decision, *, step: int | None = None,
                  resumed: int | None = None, lost: int | None = None,
                  applied: bool = True) -> str:
    """Return the one line a fault gets in the task log (and the failure's message): kind,
    culprit, decision, resume step, lost steps, under :data:`LINE_LIMIT` characters. The
    evidence and the policy's reasoning follow it (:func:`decision_details`).

    ``step``: the furthest step a rank reported; ``applied``: False in observe mode (the line
    ends at the decision: nothing resumes, nothing is lost).
    """
    ending = ""
    if applied:
        then = (f"resumes at step {'unknown' if resumed is None else resumed}"
                if decision.retry else "no retry")
        ending = f"; {then}, {'lost steps unknown' if lost is None else f'{lost} steps lost'}"
    line = ""
    for limit in NAME_LIMITS:
        node = None if fault.culprit_node is None else _short(fault.culprit_node, limit)
        culprit = dataclasses.replace(fault, culprit_node=node).culprit
        at = "" if step is None else f" at step {step}"
        out = decision.quarantine_node and (
            ", its node out" if decision.quarantine_node == fault.culprit_node
            else f", {_short(decision.quarantine_node, limit)} out")
        line = (f"Segment {segment} fault: {fault.kind.value} ({culprit}){at} -> "
                f"{decision.action} by {_short(decision.rule, limit)}{out or ''}{ending}")
        if len(line) < LINE_LIMIT:
            break
    return line


def decision_details(fault: Mapping[str, Any], decision: Decision, folder: Path,
                     logs: Path | None = None) -> str:
    """Return what follows the decision line in the task log: the evidence's summary, where
    it stopped, the policy's reasoning, and where the full record is (``fault``: the
    recorded fault, its evidence summarised by then)."""
    evidence = fault.get("evidence") or {}
    lines = [f"  evidence: {evidence.get('summary') or '-'} (all of it: fault.json in MLflow, "
             f"{folder / 'decision.json'})"]
    if evidence.get("where"):
        lines.append(f"  where it stopped: {evidence['where']}")
    lines.append(f"  why: {decision.reason} (policy sha256 {decision.policy_sha256[:12]})")
    if logs is not None:
        lines.append(f"  logs: {logs}")
    return "\n".join(lines)


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
