"""The segment task's side of handovers: adopt the workload the previous segment left
training, and hand this one's over at its end (``segment_boundary: adopt``).

Only a launcher with :class:`~relay.launchers.base.Continuity` offers them (the
local one); the mechanism is :mod:`relay.launchers.local.adopt`. Here is what
the task records around it: the adopting attempt's MLflow run, its time to
resume, and the boundary checkpoint that must be in MLflow before a segment
that hands over may succeed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException

from relay.core.attempt import Attempt, AttemptState
from relay.launchers import Launcher
from relay.lineage import resume_time
from relay.lineage.tags import TAG_ADOPTED_AT, TAG_FAILURE_REASON, TAG_HANDED_OVER_AT
from relay.nodes.pool import NodePool
from relay.operators.base import attempt_params
from relay.policy.model import LoadedPolicy
from relay.spec.job import JobSpec
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

if TYPE_CHECKING:
    from relay.operators.segment import TrainSegmentOperator

log = logging.getLogger(__name__)


def attempt_of(launcher: Launcher, folder: Path, workload: Path) -> Attempt:
    """Return the attempt of try ``folder``, watching ``workload``: one that adopted it, or
    the try that launched it."""
    if launcher.continuity is not None:
        found = launcher.continuity.attempt_at(folder)
        if found.adopted:
            return found
    return Attempt(workload)


def view(launcher: Launcher, attempt: Attempt, cfg: LaunchConfig) -> LaunchConfig:
    """Return the workload's launch config as ``attempt`` sees it (its run, its bounds)."""
    return cfg if launcher.continuity is None else launcher.continuity.view(attempt, cfg)


def boundary(launcher: Launcher, seen: LaunchConfig, workload: LaunchConfig) -> int | None:
    """Return the step whose passing completes the watched segment (None: its end)."""
    if launcher.continuity is None:
        return None
    return launcher.continuity.watch_boundary(seen, workload)


def adopt(op: TrainSegmentOperator, context: Any, spec: JobSpec,  # noqa: ANN401
          policy: LoadedPolicy, lineage: Any, parent: str, folder: Path,  # noqa: ANN401
          latest: Any, corrupt: list[Any], task_started: float,  # noqa: ANN401
          launcher: Launcher) -> bool:
    """Adopt the workload an earlier segment left running, if it may be, and watch it;
    return False when there is none to adopt (the task launches afresh)."""
    continuity = launcher.continuity
    assert continuity is not None  # the caller checked it hands over
    index, _start, end = spec.segments[op.segment]
    try_number = int(context["ti"].try_number)
    resume_step = latest.manifest.step if latest else 0
    workload = continuity.adoptable(folder.parent.parent, index, end, resume_step,
                                    NodePool().healthy())
    if workload is None:
        return False
    cfg = LaunchConfig.read(workload / LAUNCH_FILE)
    run_id = lineage.attempt_run(parent, index, try_number, {
        **continuity.kept_interval(workload, folder, cfg.checkpoint_every),
        **attempt_params(spec, policy, index, try_number, cfg.nodes, resume_step, latest,
                         folder), "adopted_workload": str(workload)})
    op._corrupt(context, lineage, run_id, corrupt, policy, folder)
    _ends, next_end = continuity.run_on(spec, index)
    at = continuity.adopt(folder, workload, run_id=run_id, segment=index, attempt=try_number,
                          resume_step=resume_step, end=end, next_end=next_end)
    if at is None:
        log.warning("Not adopting the workload %s: it went silent and was stopped first. "
                    "Launching afresh", workload)
        lineage.fence_attempt(run_id, "abandoned: the workload it was to adopt was stopped")
        lineage.finish_run(run_id, AttemptState.ABANDONED)
        return False
    lineage.set_tags(run_id, {TAG_ADOPTED_AT: str(at)})
    resume_time.note_launch(folder, task_started, time.time())
    attempt = Attempt(folder, workload)
    op._watch(context, attempt, cfg, policy, launcher,
              boundary=boundary(launcher, continuity.view(attempt, cfg), cfg), settled=True)
    return True  # not reached: _watch defers


def handed_over(op: TrainSegmentOperator, context: Any,  # noqa: ANN401
                event: dict[str, Any], attempt: Attempt, cfg: LaunchConfig,
                lineage: Any, launcher: Launcher, woke: float,  # noqa: ANN401
                parent: str) -> bool:
    """Every rank passed this segment's end: succeed once its checkpoint is in MLflow, and
    leave the workload training for the next segment's task to adopt; return True (the
    workload's nodes stay leased)."""
    continuity = launcher.continuity
    assert continuity is not None  # only a launcher with continuity has boundaries
    step = int(event["boundary_step"])
    timeout = op.policy(op.spec()).policy.detection.checkpoint_timeout
    workload = attempt.runs_in
    if not continuity.wait_published(lineage, parent, cfg.run_id, step, timeout, workload):
        launcher.stop(attempt)
        continuity.let_go(attempt)
        lineage.finish_run(cfg.run_id, AttemptState.FAILED, {
            TAG_FAILURE_REASON: f"no checkpoint at step {step} in MLflow"})
        raise AirflowException(
            f"Segment {op.segment}: every rank passed step {step}, but its checkpoint "
            f"was not in MLflow within {timeout:g}s (detection.checkpoint_timeout); the "
            "workload was stopped and the retry resumes from the latest checkpoint")
    op.log_observations(context, lineage, cfg.run_id, attempt)
    lineage.finish_run(cfg.run_id, AttemptState.COMPLETED,
                       {TAG_HANDED_OVER_AT: str(step)})
    op.resumed(context, attempt, lineage, launcher, lambda: parent)
    continuity.note_boundary(attempt, event.get("at"), woke)
    log.info("Segment %d trained steps [%d, %d); its checkpoint at step %d is in MLflow and "
             "the workload %s trains on, for the next segment to adopt", op.segment,
             cfg.start_step, cfg.end_step, step, workload)
    return True
