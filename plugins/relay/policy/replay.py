"""`relay policy replay`: re-decide a job's recorded faults under a candidate policy.

Governance owners run it before merging a policy change. Every fault recorded
in MLflow for the job (one ``decision.json`` per attempt that ended in a
fault, ``corrupt-step-*.json`` per corrupt checkpoint met, ``observed/*.json``
per fault only observed) is decided again by the same pure
:func:`~relay.policy.decide.decide`, with the same per-segment history, under the
candidate. What happened after a fault is taken as given: where the candidate
would have stopped a segment earlier, its later faults are shown as ones that
would not have happened.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from relay.core.exceptions import ReplayError
from relay.core.faults import Fault, FaultKind
from relay.lineage.store import TAG_DAG_RUN, TAG_PARENT, TAG_SEGMENT, TAG_TRY, Lineage
from relay.policy.decide import Decision, decide
from relay.policy.model import LoadedPolicy

RECORD_FILES = ("decision.json",)
RECORD_PREFIXES = ("corrupt-step-", "observed/")


@dataclass(frozen=True)
class Incident:
    """One recorded fault and the decision made then."""

    dag_run: str
    segment: int
    attempt: int
    fault: Fault
    then: Decision
    ended_attempt: bool  # False for a fault that was only observed (the attempt went on)


@dataclass(frozen=True)
class Row:
    """One incident replayed: the decision then and the candidate's now (None: not reached)."""

    incident: Incident
    now: Decision | None

    @property
    def changed(self) -> bool:
        """Return whether the candidate decides differently (action, retry, quarantine, mode)."""
        if self.now is None:
            return True
        keys = ("action", "retry", "quarantine_node", "quarantine_seconds", "observe")
        then = self.incident.then
        return any(getattr(then, k) != getattr(self.now, k) for k in keys)


def parse_since(text: str | None) -> float:
    """Return epoch seconds of an ISO date/time such as 2026-12-01 or 2026-12-01T08:00."""
    if not text:
        return 0.0
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ReplayError(f"--since: expected a date such as 2026-12-01 or 2026-12-01T08:00, "
                          f"found {text!r}") from None


def replay(incidents: Sequence[Incident], policy: Any, sha256: str) -> list[Row]:  # noqa: ANN401
    """Decide every incident again under ``policy``, with each segment's own history."""
    rows: list[Row] = []
    history: dict[tuple[str, int], list[FaultKind]] = {}
    stopped: set[tuple[str, int]] = set()
    for incident in incidents:
        key = (incident.dag_run, incident.segment)
        past = history.setdefault(key, [])
        if key in stopped:
            rows.append(Row(incident, None))
            continue
        now = decide(incident.fault, past, policy, sha256)
        rows.append(Row(incident, now))
        if not now.retry and not now.observe:
            stopped.add(key)  # it gives up here: the segment's later faults never happen
        if incident.ended_attempt:
            past.append(incident.fault.kind)
    return rows


def _totals(decisions: Iterable[Decision]) -> dict[str, Any]:
    ds = list(decisions)
    quarantined = sorted({d.quarantine_node for d in ds if d.quarantine_node and not d.observe})
    return {
        "retries": sum(1 for d in ds if d.retry and not d.observe),
        "escalations": sum(1 for d in ds if d.action == "escalate" and not d.observe),
        "observed": sum(1 for d in ds if d.observe),
        "quarantined": quarantined,
    }


def summary(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Return then-vs-now totals: retry attempts spent, escalations, nodes quarantined."""
    return {
        "then": _totals(r.incident.then for r in rows),
        "now": _totals(r.now for r in rows if r.now is not None),
    }


def _line(d: Decision) -> str:
    mode = " [observe only]" if d.observe else ""
    quarantine = f", quarantine {d.quarantine_node}" if d.quarantine_node else ""
    return f"{d.action}{mode}{quarantine} - {d.reason} (policy {d.policy_sha256[:12]})"


def format_report(rows: Sequence[Row], candidate: LoadedPolicy, job: str) -> str:
    """Return the per-fault then-vs-now lines and the summary, for the governance owner."""
    out = []
    for row in rows:
        i = row.incident
        mark = "CHANGED" if row.changed else "same"
        out.append(f"{i.dag_run} segment {i.segment} try {i.attempt}: {i.fault.describe()} "
                   f"[{mark}]")
        out.append(f"  then: {_line(i.then)}")
        out.append("  now:  " + (_line(row.now) if row.now else
                                  "not reached: the candidate stops this segment earlier"))
    totals = summary(rows)
    then, now = totals["then"], totals["now"]
    changed = sum(1 for r in rows if r.changed)
    out += [
        "",
        f"Replayed {len(rows)} recorded fault(s) of job {job} under {candidate.path} "
        f"(sha256 {candidate.sha256[:12]}): {changed} decision(s) change.",
        f"  attempts spent on retries: then {then['retries']}, now {now['retries']}",
        f"  escalations:               then {then['escalations']}, now {now['escalations']}",
        f"  nodes quarantined:         then {', '.join(then['quarantined']) or 'none'}, "
        f"now {', '.join(now['quarantined']) or 'none'}",
        f"  observed only:             then {then['observed']}, now {now['observed']}",
    ]
    return "\n".join(out)


def _records(lineage: Lineage, run_id: str, tmp: Path) -> list[tuple[str, dict[str, Any]]]:
    """Return (artifact path, record) for each fault record logged on an attempt run."""
    client = lineage.client
    names = [a.path for a in lineage._call(client.list_artifacts, run_id)]
    if "observed" in names:
        names += [a.path for a in lineage._call(client.list_artifacts, run_id, "observed")]
    wanted = sorted(n for n in names if n.endswith(".json")
                    and (n in RECORD_FILES or n.startswith(RECORD_PREFIXES)))
    # Faults met before the attempt's own end come first: corrupt checkpoints, observations.
    wanted.sort(key=lambda n: n in RECORD_FILES)
    found = []
    for name in wanted:
        local = lineage._call(client.download_artifacts, run_id, name, str(tmp))
        found.append((name, json.loads(Path(local).read_text())))
    return found


def load_incidents(lineage: Lineage, job: str, since: float = 0.0) -> list[Incident]:
    """Read every recorded fault of ``job`` from MLflow, oldest DAG run and attempt first."""
    experiment = lineage._call(lineage.client.get_experiment_by_name, f"relay/{job}")
    if experiment is None:
        raise ReplayError(f"job {job!r}: expected an MLflow experiment relay/{job}, found none. "
                          "Check the job name and RELAY_MLFLOW_TRACKING_URI.")
    runs = lineage._call(
        lineage.client.search_runs, [experiment.experiment_id],
        filter_string=f"attributes.start_time >= {int(since * 1000)}",
        max_results=10_000, order_by=["attributes.start_time ASC"])
    incidents: list[Incident] = []
    with tempfile.TemporaryDirectory() as tmp:
        for parent in (r for r in runs if TAG_PARENT not in r.data.tags):
            dag_run = parent.data.tags.get(TAG_DAG_RUN, parent.info.run_id)
            for child in lineage.child_runs(parent.info.run_id):
                tags = child.data.tags
                for name, record in _records(lineage, child.info.run_id, Path(tmp)):
                    if "fault" not in record or "decision" not in record:
                        continue
                    incidents.append(Incident(
                        dag_run=dag_run, segment=int(tags.get(TAG_SEGMENT, -1)),
                        attempt=int(tags.get(TAG_TRY, 0)),
                        fault=Fault.from_event(record["fault"]),
                        then=Decision.from_dict(record["decision"]),
                        ended_attempt=name in RECORD_FILES,
                    ))
    return incidents
