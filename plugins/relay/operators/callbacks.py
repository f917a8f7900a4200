"""Close a DAG run's MLflow parent run as FAILED, with the reason, however the run ends badly.

Only the finalize task closes the parent run on success. Any other end
(an escalation, too few nodes, a bad run conf after preflight, a task killed
for good) goes through these callbacks: the task's ``on_failure_callback``
(it knows the exception) and the DAG's (it catches what no task reported).
No run is left RUNNING. A callback never raises: it is bookkeeping.
"""

from __future__ import annotations

import logging
from typing import Any

from relay.core.attempt import AttemptState
from relay.lineage.tags import TAG_FAILED_TASK, TAG_FAILURE_REASON

log = logging.getLogger(__name__)



class CloseParentRunOnFailure:
    """An ``on_failure_callback`` (task or DAG level) for one job's DAG."""

    def __init__(self, job: str) -> None:
        self.job = job

    def __call__(self, context: Any) -> None:  # noqa: ANN401 - Airflow's context mapping
        """Stop what still trains for the DAG run; close its parent run as failed."""
        try:  # first: a frozen rank may hold the embedded tracking store's lock
            self._stop_workloads(context)
        except Exception:  # noqa: BLE001 - never let bookkeeping fail the callback
            log.exception("Could not stop the workloads of this DAG run")
        try:
            self._close(context)
        except Exception:  # noqa: BLE001 - never let bookkeeping fail the callback
            log.exception("Could not close the MLflow run of this DAG run")

    @staticmethod
    def _stop_workloads(context: Any) -> None:  # noqa: ANN401
        """Stop a workload handed over at a boundary that no later segment will adopt, and
        end the DAG run's node lease."""
        from relay.core import settings
        from relay.core.paths import safe_name
        from relay.launchers import launcher_from
        from relay.nodes.pool import lease_holder
        from relay.operators.base import end_run

        dag_run = context.get("dag_run")
        if dag_run is None:
            return
        run_dir = settings.runs_dir() / dag_run.dag_id / safe_name(dag_run.run_id)
        holder = lease_holder(dag_run.dag_id, dag_run.run_id)
        log.info("Stopping the workloads of DAG run %s: it failed", dag_run.run_id)
        end_run(launcher_from(None), run_dir, holder, stop_workloads=True)

    def _close(self, context: Any) -> None:  # noqa: ANN401
        from mlflow.entities import RunStatus

        from relay.lineage.store import TAG_DAG_RUN, Lineage

        dag_run = context.get("dag_run")
        if dag_run is None:
            return
        lineage = Lineage.from_settings()
        experiment = lineage.client.get_experiment_by_name(f"relay/{self.job}")
        if experiment is None:
            return  # nothing was opened (e.g. refused in preflight)
        runs = lineage.client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`{TAG_DAG_RUN}` = '{dag_run.run_id}'",
            max_results=1)
        if not runs or runs[0].info.status != RunStatus.to_string(RunStatus.RUNNING):
            return
        ti = context.get("ti") or context.get("task_instance")
        exception = context.get("exception")
        reason = (f"{type(exception).__name__}: {exception}" if exception is not None
                  else str(context.get("reason") or "the DAG run failed"))
        tags = {TAG_FAILURE_REASON: reason[:4000]}
        if ti is not None:
            tags[TAG_FAILED_TASK] = str(ti.task_id)
        lineage.finish_run(runs[0].info.run_id, AttemptState.FAILED, tags)
        from relay.lineage.summary import log_run_summary

        log_run_summary(lineage, runs[0].info.run_id)  # its faults and what they cost
        log.error("Closed MLflow run %s of DAG run %s as FAILED: %s", runs[0].info.run_id,
                  dag_run.run_id, reason)
