"""One DAG run as Relay recorded it, read back from MLflow: attempts, faults, goodput, progress.

The Recovery page, `relay report` and its JSON all read this one structure.
Everything here comes from what Relay already logs (the parent run's params,
each attempt run's params, tags, metrics and ``decision.json``) plus the node
pool's quarantines and the attempt folders' start-up markers.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.core.attempt import AttemptState
from relay.lineage.report import FaultRow, _json_artifact, fault_rows, first_step_at, step_field
from relay.lineage.store import TAG_DAG_RUN, TAG_OUTCOME, TAG_SEGMENT, TAG_TRY, Lineage
from relay.lineage.tags import TAG_ADOPTED_AT, TAG_HANDED_OVER_AT
from relay.nodes.pool import NodePool
from relay_train.protocol.heartbeat import read_heartbeats


@dataclass(frozen=True)
class AttemptView:
    """One segment attempt (one launch of one Airflow try)."""

    segment: int
    try_number: int
    run_id: str
    nodes: list[str]
    resume_step: int
    end_step: int
    outcome: str
    started_at: float
    ended_at: float | None
    productive_at: float | None
    reached_step: int | None
    fault: dict[str, Any] | None = None
    decision: dict[str, Any] | None = None
    lost_steps: int | None = None
    next_resume_step: int | None = None
    checkpoint_every: int | None = None  # the interval this attempt checkpointed at
    checkpoint_every_reason: str | None = None  # how it was chosen (checkpoint_every: auto)
    attempt_dir: str = ""  # the try's folder (on Relay's side)
    handed_over_at: int | None = None  # left its workload training at this step, for the next
    adopted_at: int | None = None  # took over an earlier attempt's workload at this step
    adopted_workload: str | None = None  # the folder of the attempt whose workload it took


@dataclass(frozen=True)
class RunView:
    """A DAG run's recovery record."""

    job: str
    dag_id: str
    dag_run_id: str
    parent_run_id: str
    outcome: str
    total_steps: int
    policy_sha256: str
    started_at: float
    ended_at: float | None
    attempts: list[AttemptView]
    faults: list[FaultRow]
    progress_step: int
    goodput: dict[str, Any]
    eta_seconds: float | None
    quarantines: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (times as Unix seconds)."""
        return asdict(self)

    def summary(self) -> RunSummary:
        """Return the run's figures at a glance (the Recovery index, the DAG run's note)."""
        lost = [f.lost_steps for f in self.faults]
        return RunSummary(
            outcome=self.outcome, faults=len(self.faults),
            lost_steps=None if None in lost else sum(x or 0 for x in lost),
            time_lost_seconds=round(sum(self.goodput["lost_seconds_by_fault"].values()), 3),
            ettr=self.goodput["ettr"])


@dataclass(frozen=True)
class RunSummary:
    """A DAG run's figures at a glance (``lost_steps`` None: a fault's count is unknown;
    ``time_lost_seconds``: :func:`goodput`'s, every fault's, still growing while a retry
    has not reached its first step)."""

    outcome: str
    faults: int
    lost_steps: int | None
    time_lost_seconds: float
    ettr: float


def _attempt(lineage: Lineage, child: Any) -> AttemptView:  # noqa: ANN401 - an MLflow Run
    params, tags, info = child.data.params, child.data.tags, child.info
    attempt_dir = Path(params.get("attempt_dir", "/nonexistent"))
    record = None
    if AttemptState.from_outcome(tags.get(TAG_OUTCOME)) is AttemptState.FAULTED:
        record = _json_artifact(lineage, info.run_id, "decision.json")
    reached = None
    history = lineage.client.get_metric_history(info.run_id, "loss")
    if history:
        reached = max(m.step for m in history)
    beats = read_heartbeats(attempt_dir / "heartbeats") if attempt_dir.is_dir() else {}
    if beats:
        reached = max(reached or 0, min(b.step for b in beats.values()))
    return AttemptView(
        segment=int(tags.get(TAG_SEGMENT, -1)), try_number=int(tags.get(TAG_TRY, 0)),
        run_id=info.run_id, nodes=[n for n in params.get("nodes", "").split(",") if n],
        resume_step=int(params.get("resume_step", 0)), end_step=int(params.get("end_step", 0)),
        outcome=AttemptState.from_outcome(tags.get(TAG_OUTCOME)), started_at=info.start_time / 1000,
        ended_at=info.end_time / 1000 if info.end_time else None,
        productive_at=first_step_at(attempt_dir), reached_step=reached,
        fault=record["fault"] if record else None, decision=record["decision"] if record else None,
        lost_steps=step_field(record, "lost_steps", info.run_id),
        next_resume_step=step_field(record, "next_resume_step", info.run_id),
        checkpoint_every=int(params["checkpoint_every"]) if "checkpoint_every" in params else None,
        checkpoint_every_reason=params.get("checkpoint_every_reason"),
        attempt_dir=params.get("attempt_dir", ""),
        handed_over_at=_int_or_none(tags.get(TAG_HANDED_OVER_AT)),
        adopted_at=_int_or_none(tags.get(TAG_ADOPTED_AT)),
        adopted_workload=params.get("adopted_workload"),
    )


def _int_or_none(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:  # a tag anyone may write: not a step reads as unknown
        return None


def goodput(attempts: list[AttemptView], faults: list[FaultRow], started: float,
            ended: float | None, now: float) -> dict[str, Any]:
    """Return ETTR (productive / elapsed) and the time lost per fault class.

    Productive time is each attempt's time from its first step to its end, less
    the steps it trained that a retry trained again (lost steps, at the attempt's
    own pace). Time lost to a fault runs from when it struck (detection time less
    the detection delay, when known) to the retry's first step, plus lost steps.
    """
    elapsed = max((ended or now) - started, 1e-9)
    productive = 0.0
    lost_by_kind: dict[str, float] = {}
    for a in attempts:
        stop = a.ended_at or now
        if a.fault is not None:  # the fault struck before it was detected
            stop = a.fault["detected_at"] - _detect_delay(faults, a)
        span = max(stop - a.productive_at, 0.0) if a.productive_at is not None else 0.0
        steps = max((a.reached_step or a.resume_step) - a.resume_step, 1)
        wasted = span * min((a.lost_steps or 0) / steps, 1.0)
        if a.fault is not None:
            retry = _next_productive(attempts, a)
            cost = wasted + max((retry or now) - stop, 0.0)
            lost_by_kind[a.fault["kind"]] = lost_by_kind.get(a.fault["kind"], 0.0) + cost
        productive += span - wasted
    return {"elapsed_seconds": round(elapsed, 3), "productive_seconds": round(productive, 3),
            "ettr": round(min(productive / elapsed, 1.0), 4),
            "lost_seconds_by_fault": {k: round(v, 3) for k, v in lost_by_kind.items()}}


def _next_productive(attempts: list[AttemptView], a: AttemptView) -> float | None:
    later = [x.productive_at for x in attempts
             if x.segment == a.segment and x.try_number > a.try_number and x.productive_at]
    return min(later) if later else None


def _detect_delay(faults: list[FaultRow], a: AttemptView) -> float:
    for row in faults:
        if row.segment == a.segment and row.detected_after is not None:
            return float(row.detected_after)
    return 0.0


def _progress(attempts: list[AttemptView], total: int, now: float,
              finished: bool) -> tuple[int, float | None]:
    step = max((a.next_resume_step or 0 for a in attempts), default=0)
    done = [a for a in attempts if a.outcome == AttemptState.COMPLETED]
    step = max([step, *(a.end_step for a in done), *(a.reached_step or 0 for a in attempts)])
    step = min(step, total)
    if finished or step >= total:
        return step, 0.0
    paced = [(a.end_step - a.resume_step, (a.ended_at or now) - a.productive_at)
             for a in done if a.productive_at and a.end_step > a.resume_step]
    if not paced:
        return step, None
    sec_per_step = sum(t for _, t in paced) / sum(s for s, _ in paced)
    return step, round((total - step) * sec_per_step, 1)


def run_view(lineage: Lineage, parent_run_id: str) -> RunView:
    """Read one DAG run's record from MLflow."""
    parent = lineage.client.get_run(parent_run_id)
    params, tags = parent.data.params, parent.data.tags
    attempts = [_attempt(lineage, c) for c in lineage.child_runs(parent_run_id)]
    faults = fault_rows(lineage, parent_run_id)
    now = time.time()
    started = parent.info.start_time / 1000
    ended = parent.info.end_time / 1000 if parent.info.end_time else None
    total = int(params.get("total_steps", 0))
    outcome = AttemptState.from_outcome(tags.get(TAG_OUTCOME))
    step, eta = _progress(attempts, total, now, outcome == "completed")
    quarantines = [asdict(q) for q in NodePool().quarantines(now).values()]
    return RunView(
        job=tags.get("relay.job", ""), dag_id=tags.get("relay.dag_id", ""),
        dag_run_id=tags.get(TAG_DAG_RUN, ""), parent_run_id=parent_run_id, outcome=outcome,
        total_steps=total, policy_sha256=params.get("policy_sha256", ""), started_at=started,
        ended_at=ended, attempts=attempts, faults=faults, progress_step=step,
        goodput=goodput(attempts, faults, started, ended, now), eta_seconds=eta,
        quarantines=quarantines,
    )


def find_parent(lineage: Lineage, job: str, dag_run_id: str | None) -> str:
    """Return the MLflow run of a DAG run of ``job`` (the newest one without ``dag_run_id``)."""
    query = (f"tags.`{TAG_DAG_RUN}` = '{dag_run_id}'" if dag_run_id
             else f"tags.`{TAG_DAG_RUN}` != ''")
    experiment = lineage.find_experiment_id(job)
    runs = [] if experiment is None else lineage.client.search_runs(
        [experiment], filter_string=query, order_by=["attributes.start_time DESC"],
        max_results=1)
    if not runs:
        which = f"DAG run {dag_run_id}" if dag_run_id else "any DAG run"
        raise LookupError(f"No MLflow record of {which} of job {job} in {lineage.tracking_uri}. "
                          "Check the job name and run id (`relay report JOB --run RUN_ID`).")
    return str(runs[0].info.run_id)


def dag_runs(lineage: Lineage, job: str, limit: int = 50) -> list[Any]:
    """Return the newest DAG-run MLflow runs of ``job`` (none if it has no experiment yet)."""
    experiment = lineage.find_experiment_id(job)
    if experiment is None:
        return []
    return list(lineage.client.search_runs(
        [experiment], filter_string=f"tags.`{TAG_DAG_RUN}` != ''",
        order_by=["attributes.start_time DESC"], max_results=limit,
    ))
