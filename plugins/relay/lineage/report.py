"""Recovery reports read back from MLflow: where to look, what faulted, what it cost."""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.core.attempt import AttemptState
from relay.lineage.resume_time import (
    KEY,
    TimeToResume,
    fault_onset,
    from_breakdown,
    time_to_resume,
)
from relay.lineage.store import TAG_DAG_ID, TAG_OUTCOME, TAG_SEGMENT, TAG_TRY, Lineage
from relay_train.protocol.injection import CHAOS_LOG
from relay_train.protocol.launch import FIRST_STEP_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultRow:
    """One fault of a DAG run and what recovering from it cost (``detected_after`` and
    ``time_to_resume``: :func:`relay.lineage.resume_time.time_to_resume`'s detection part
    and total, onset to the retry's first productive step)."""

    segment: int
    kind: str
    culprit: str
    detected_after: float | None
    decision: str
    lost_steps: int | None
    time_to_resume: float | None
    try_number: int = 0
    rank: int | None = None
    node: str | None = None
    rule: str = ""
    retry: bool = False  # the policy retries (else it gave up: escalate, abort)
    step: int | None = None  # the furthest step a rank reported
    resume_step: int | None = None
    retry_nodes: list[str] | None = None  # where the retry runs (None: not launched yet)


def newest_parent(lineage: Lineage, job: str, dag_id: str, since: float = 0.0) -> str | None:
    """Return the newest DAG-run MLflow run of ``dag_id`` started after ``since``."""
    runs = lineage.client.search_runs(
        [lineage.experiment_id(job)], filter_string=f"tags.`{TAG_DAG_ID}` = '{dag_id}'",
        order_by=["attributes.start_time DESC"], max_results=1,
    )
    if not runs or runs[0].info.start_time / 1000 < since - 5:
        return None
    return str(runs[0].info.run_id)


def reference_run(lineage: Lineage, job: str, spec_sha256: str) -> str | None:
    """Return a completed fault-free DAG run of the same spec, if one exists."""
    runs = lineage.client.search_runs(
        [lineage.experiment_id(job)],
        filter_string=(f"params.spec_sha256 = '{spec_sha256}' and params.chaos = '[]' "
                       f"and tags.`{TAG_OUTCOME}` = '{AttemptState.COMPLETED.value}'"),
        order_by=["attributes.start_time DESC"], max_results=1,
    )
    return str(runs[0].info.run_id) if runs else None


def _json_artifact(lineage: Lineage, run_id: str, name: str) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = lineage.client.download_artifacts(run_id, name, tmp)
        except Exception:  # noqa: BLE001 - a missing artifact reads as "not recorded"
            return None
        return dict(json.loads(Path(path).read_text()))


def step_field(record: dict[str, Any] | None, name: str, run_id: str) -> int | None:
    """Return a step count of a ``decision.json`` (``lost_steps``, ``next_resume_step``), or
    None when absent or not an integer: anyone who can write to MLflow can write that file."""
    value = None if record is None else record.get(name)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    log.warning("decision.json of MLflow run %s: expected an integer %s, found %.80r; "
                "shown as unknown", run_id, name, value)
    return None


def chaos_strikes(attempt_dir: Path) -> list[dict[str, Any]]:
    """Return the faults injected into an attempt (its chaos.jsonl), in order."""
    path = attempt_dir / CHAOS_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_step_at(attempt_dir: Path) -> float | None:
    """Return when an attempt finished its first step (None if it never did)."""
    path = attempt_dir / FIRST_STEP_FILE
    return float(json.loads(path.read_text())["at"]) if path.exists() else None


def _resumed(record: dict[str, Any], child: Any, retry: Any) -> TimeToResume:  # noqa: ANN401
    """Return a fault's time to resume: as its decision.json's complete breakdown has it (what
    MLflow logged), else from the attempt folders on this machine."""
    found = record.get(KEY)
    if isinstance(found, dict) and found.get("complete"):
        try:
            return from_breakdown(found["marks"], found["onset"] != "unknown")
        except (KeyError, TypeError):  # anyone who can write to MLflow writes that file
            log.warning("decision.json of MLflow run %s: unreadable %s breakdown; read from "
                        "the attempt folders instead", child.info.run_id, KEY)
    onset = fault_onset(Path(child.data.params.get("attempt_dir", "/nonexistent")))
    first = None if retry is None else first_step_at(
        Path(retry.data.params.get("attempt_dir", "/nonexistent")))
    return time_to_resume(onset, record["fault"]["detected_at"], first)


def fault_rows(lineage: Lineage, parent: str) -> list[FaultRow]:
    """Return one row per fault in a DAG run, oldest first."""
    children = lineage.child_runs(parent)
    by_key = {(c.data.tags.get(TAG_SEGMENT), c.data.tags.get(TAG_TRY)): c for c in children}
    rows = []
    for child in children:
        if AttemptState.from_outcome(child.data.tags.get(TAG_OUTCOME)) is not AttemptState.FAULTED:
            continue
        record = _json_artifact(lineage, child.info.run_id, "decision.json")
        if record is None:
            continue
        fault, decision = record["fault"], record["decision"]
        segment, tried = child.data.tags[TAG_SEGMENT], int(child.data.tags[TAG_TRY])
        retry = by_key.get((segment, str(tried + 1)))
        resumed = _resumed(record, child, retry)
        who = ", ".join(
            x for x in (
                f"rank {fault['culprit_rank']}" if fault["culprit_rank"] is not None else "",
                fault["culprit_node"] or "",
            ) if x
        ) or "job-wide"
        action = decision["action"]
        if decision.get("quarantine_node"):
            action += f" ({decision['quarantine_node']} out)"
        rows.append(FaultRow(
            int(segment), fault["kind"], who, resumed.detect, action,
            step_field(record, "lost_steps", child.info.run_id), resumed.total,
            try_number=tried, rank=fault["culprit_rank"], node=fault["culprit_node"],
            rule=str(decision.get("rule", "")), retry=bool(decision.get("retry")),
            step=step_field(record, "progress_step", child.info.run_id),
            resume_step=step_field(record, "next_resume_step", child.info.run_id),
            retry_nodes=None if retry is None else [
                n for n in retry.data.params.get("nodes", "").split(",") if n]))
    return rows


def format_fault_table(rows: list[FaultRow]) -> str:
    """Return the fault table as aligned text."""
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}s"

    head = (f"  {'seg':>3}  {'fault':18} {'culprit':16} {'detected after':>14}  "
            f"{'decision':34} {'lost steps':>10} {'time to resume':>14}")
    lines = [head]
    for r in rows:
        lost = "-" if r.lost_steps is None else str(r.lost_steps)
        lines.append(f"  {r.segment:>3}  {r.kind:18} {r.culprit:16} {sec(r.detected_after):>14}  "
                     f"{r.decision:34} {lost:>10} {sec(r.time_to_resume):>14}")
    return "\n".join(lines)


def final_state(lineage: Lineage, parent: str, where: Path) -> dict[str, Any] | None:
    """Download and load a DAG run's final checkpoint (sha256 verified)."""
    import torch

    verified = lineage.latest_valid_checkpoint(parent, where)
    if verified is None:
        return None
    return dict(torch.load(verified.path, map_location="cpu", weights_only=True))


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, str]:
    """Return whether two checkpoints hold bit-identical weights and optimizer state
    (else where they first differ)."""
    from relay.lineage.compare import first_difference

    if a["step"] != b["step"]:
        return False, f"different steps ({a['step']} vs {b['step']})"
    found = first_difference({"model": a["model"], "optimizer": a["optimizer"]["state"]},
                             {"model": b["model"], "optimizer": b["optimizer"]["state"]})
    if found is not None:
        return False, f"they differ at {found.describe()}"
    return True, f"{len(a['model'])} tensors and the optimizer state are identical"
