"""Airflow operators: the common base, preflight and finalize.

The segment operator (launch -> defer -> decide) is in :mod:`relay.operators.segment`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from relay.core import settings
from relay.core.attempt import AttemptState
from relay.core.checkpoint_keys import checkpoint_keys
from relay.core.exceptions import ChaosConfError
from relay.core.paths import safe_name
from relay.launchers import Launcher
from relay.lineage.resume_time import PREFLIGHT_FILE
from relay.lineage.tags import TAG_FINAL_CHECKPOINT, TAG_FINAL_SHA256
from relay.nodes.pool import NodePool, lease_holder
from relay.policy.model import LoadedPolicy, load_policy
from relay.spec.chaos_conf import chaos_faults
from relay.spec.entry_check import import_problem
from relay.spec.job import JobSpec, load_job_spec
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.run_lease import RUN_LEASE_SECONDS

log = logging.getLogger(__name__)


def segment_dir(spec: JobSpec, dag_run_id: str, segment: int) -> Path:
    """Return the folder that holds every attempt of one segment of one DAG run."""
    return settings.runs_dir() / spec.dag_id / safe_name(dag_run_id) / f"segment-{segment:03d}"


def lineage_store():  # noqa: ANN201 - imported lazily: DAG parsing must not import MLflow
    from relay.lineage.store import Lineage
    from relay.operators.quick_exit import freeze_heap_at_exit

    freeze_heap_at_exit()  # MLflow's heap makes the task process's exit slow (see quick_exit)
    return Lineage.from_settings()


def end_run(launcher: Launcher, run_dir: Path, holder: str, stop_workloads: bool) -> None:
    """The DAG run is over (finalized, or failed): stop what still trains for it, its warm
    agents, and end its nodes' lease, so that nothing outlives the run and the next run
    gets the nodes. A workload handed over at a boundary keeps the run's lease while no
    task watches it; a task that ends without its own ``execute_complete`` (nothing left
    to train) would otherwise leave that lease to expire hours later."""
    if launcher.continuity is not None:
        for root in launcher.continuity.end_run(run_dir, stop_workloads):
            log.warning("Stopped the workload %s: nothing may outlive its DAG run", root)
    freed = NodePool().release_lease(holder)
    if freed:
        log.info("DAG run %s is over: released node(s) %s", holder, ", ".join(freed))


def _end_run(spec: JobSpec, dag_run_id: str) -> None:
    """End the DAG run's workloads, warm agents and node lease (:func:`end_run`)."""
    from relay.launchers import launcher_for

    run_dir = segment_dir(spec, dag_run_id, 0).parent
    launcher = launcher_for(spec)
    hands_over = launcher.continuity is not None and launcher.continuity.hands_over(spec)
    end_run(launcher, run_dir, lease_holder(spec.dag_id, dag_run_id), hands_over)
    try:  # lift the taints of quarantines that ended since the last launch (Kubernetes)
        launcher.enforce_quarantines(NodePool().quarantines())
    except Exception:  # noqa: BLE001 - the run's result stands; the next launch tries again
        log.exception("Could not bring the nodes' quarantine taints up to date")


def _models_link(lineage: Any, parent: str) -> str:  # noqa: ANN401 - a Lineage
    """Return ", models: <the experiment's Models tab>" when MLflow has a UI (a server)."""
    from relay.lineage.links import experiment_url, ui_of

    ui = ui_of(lineage.tracking_uri)
    if ui is None:
        return ""
    experiment = lineage.client.get_run(parent).info.experiment_id
    return f"; models: {experiment_url(ui, experiment, 'models')}"


def attempt_params(spec: JobSpec, policy: LoadedPolicy, index: int, try_number: int,
                   nodes: list[str], resume_step: int, latest: Any,  # noqa: ANN401
                   folder: Path) -> dict[str, Any]:
    """Return the MLflow params of an attempt's run (besides its checkpoint interval)."""
    return {"segment": index, "attempt": try_number, "nodes": ",".join(nodes),
            "resume_step": resume_step, "end_step": spec.segments[index][2],
            "world_size": spec.world_size,
            "resume_checkpoint": str(latest.manifest.ref) if latest else "none (step 0)",
            "policy_sha256": policy.sha256, "attempt_dir": str(folder)}


class RelayOperator(BaseOperator):
    """Common ground: the job spec file, loaded (and validated) at run time."""

    ui_color = "#d7ecff"

    def __init__(self, *, spec_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec_file = spec_file

    def spec(self) -> JobSpec:
        """Load the job spec as it is now on disk."""
        return load_job_spec(Path(self.spec_file))

    def policy(self, spec: JobSpec) -> LoadedPolicy:
        """Load the job's recovery policy; refuse one whose timeouts cannot work."""
        loaded = load_policy(spec.policy_path(Path(self.spec_file)))
        detection = loaded.policy.detection
        if detection.heartbeat_timeout < 2 * spec.heartbeat_interval:
            raise AirflowException(
                f"{loaded.path}: detection.heartbeat_timeout is {detection.heartbeat_timeout:g}s, "
                f"but {self.spec_file} writes heartbeats every {spec.heartbeat_interval:g}s; "
                "expected at least two intervals. Raise heartbeat_timeout or lower "
                "heartbeat_interval."
            )
        return loaded


class PreflightOperator(RelayOperator):
    """Check the spec, the tracking store and the nodes; open the DAG run's MLflow run."""

    def execute(self, context: Any) -> str:  # noqa: ANN401
        """Return the parent MLflow run id."""
        started = time.time()
        spec = self.spec()
        policy = self.policy(spec)
        try:  # before any MLflow run exists: a refused conf leaves nothing RUNNING behind
            chaos = chaos_faults(context["dag_run"].conf, spec, Path(self.spec_file))
        except ChaosConfError as exc:
            raise AirflowFailException(str(exc)) from exc
        problem = import_problem(spec, Path(self.spec_file))  # before any node is taken
        if problem is not None:
            raise AirflowFailException(problem)
        self._warm_first_segment(spec, context["dag_run"].run_id, context["dag_run"].conf)
        lineage = lineage_store()
        nodes = NodePool().healthy()
        params = {
            "spec_file": self.spec_file,
            "seed": spec.seed,
            "total_steps": spec.total_steps,
            "steps_per_segment": spec.steps_per_segment,
            "checkpoint_every": spec.checkpoint_every_text(),
            "world_size": spec.world_size,
            "policy_file": str(policy.path),
            "policy_sha256": policy.sha256,
            "spec_sha256": hashlib.sha256(Path(self.spec_file).read_bytes()).hexdigest(),
            "chaos": json.dumps(chaos, sort_keys=True),
        }
        parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id, params)
        log.info(
            "Job %s: %d steps in %d segments on %d nodes x %d ranks; healthy nodes now: %s; "
            "policy %s (sha256 %s); MLflow run %s",
            spec.job, spec.total_steps, len(spec.segments), spec.nodes, spec.ranks_per_node,
            ", ".join(nodes), policy.path, policy.sha256[:12], parent,
        )
        if len(nodes) < spec.nodes:
            log.warning("Only %d healthy node(s) for %d needed: segments will follow the "
                        "policy's nodes.when_too_few", len(nodes), spec.nodes)
        # When Relay's first line ran: what came before it in a DAG run was Airflow's.
        run_dir = segment_dir(spec, context["dag_run"].run_id, 0).parent
        run_dir.mkdir(parents=True, exist_ok=True)  # no standby made it (no nodes yet)
        write_atomically(run_dir / PREFLIGHT_FILE, json.dumps(
            {"started_at": started, "ended_at": time.time(), "mlflow_run": parent}))
        return parent

    @staticmethod
    def _warm_first_segment(spec: JobSpec, dag_run_id: str, conf: object) -> None:
        """Have the first segment's agents preload meanwhile (MLflow, Airflow's hop).

        A launcher with continuity keeps an agent resident for the DAG run (the local
        launcher one per run, its nodes sharing one host), started now on the first of
        the nodes the first lease will pick unless the pool changes first. The segment's
        launch then gets its standbys forked from it, preloaded, and so does every later
        retry: the run imports the training stack once. A resident that Relay's runner
        prestarted beside Airflow's start-up (named in the conf) is the run's if the
        launcher can use it, and stopped if not.
        """
        from relay.launchers import launcher_for

        launcher = launcher_for(spec)
        if launcher.continuity is None:
            return
        nodes = NodePool().next_lease(lease_holder(spec.dag_id, dag_run_id), spec.nodes)
        # No nodes: the segment waits for nodes (or fails); a prestarted resident is let go.
        launcher.continuity.keep_run(segment_dir(spec, dag_run_id, 0).parent, RUN_LEASE_SECONDS)
        launcher.continuity.prepare_run(segment_dir(spec, dag_run_id, 0).parent,
                                        launcher.slots(nodes) if nodes else [], conf,
                                        spec.dag_id)


class FinalizeOperator(RelayOperator):
    """Check the checkpoint chain reaches the last step, and close the DAG run's MLflow run."""

    def execute(self, context: Any) -> dict[str, Any]:  # noqa: ANN401
        """Return the final checkpoint and the chain back to step 0."""
        spec = self.spec()
        _end_run(spec, context["dag_run"].run_id)
        lineage = lineage_store()
        parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id)
        chain = lineage.chain(parent)
        if not chain or chain[0].step != spec.total_steps:
            found = chain[0].step if chain else "none"
            raise AirflowException(
                f"Job {spec.job}: expected a final checkpoint at step {spec.total_steps}, "
                f"found {found}. Clear the last segment task to train the missing steps."
            )
        if chain[-1].parent is not None:
            raise AirflowException(
                f"Job {spec.job}: the checkpoint chain breaks at step {chain[-1].step} "
                f"(its parent {chain[-1].parent} is missing from MLflow run {parent})."
            )
        from relay.lineage.models import record_chain
        from relay.lineage.summary import lineage_record, log_run_summary

        summary = lineage_record(lineage, parent, chain)
        lineage.log_json(parent, "lineage.json", summary)
        try:  # the Models tab's view of the chain; the chain itself is logged above
            record_chain(lineage, parent, chain, checkpoint_keys())
        except Exception:  # noqa: BLE001 - the run's record stands without its models
            log.exception("Could not record the checkpoints of run %s as MLflow models", parent)
        lineage.finish_run(
            parent, AttemptState.COMPLETED,
            {TAG_FINAL_CHECKPOINT: str(chain[0].ref), TAG_FINAL_SHA256: chain[0].sha256},
        )
        log_run_summary(lineage, parent)
        log.info("Final checkpoint %s; chain of %d checkpoints back to step 0 logged to run %s%s",
                 chain[0].ref, len(chain), parent, _models_link(lineage, parent))
        return summary
