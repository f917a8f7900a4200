"""Airflow operators: preflight, one training segment (launch -> defer -> decide), finalize.

Nothing survives deferral, so ``execute_complete`` finds the workload again
from the event and the attempt folder. A failed segment raises, and Airflow's
own retry runs it again from whatever the latest valid checkpoint then is.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from relay import settings
from relay.faults import Fault
from relay.launchers.local import LocalLauncher, free_port
from relay.nodes import select_nodes
from relay.policy import LoadedPolicy, load_policy
from relay.spec import JobSpec, load_job_spec
from relay.triggers import SegmentWatchTrigger
from training.chaos import Fault as ChaosFault
from training.launch import LAUNCH_FILE, LaunchConfig, ResumeFrom

log = logging.getLogger(__name__)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def segment_dir(spec: JobSpec, dag_run_id: str, segment: int) -> Path:
    """Return the folder that holds every attempt of one segment of one DAG run."""
    return settings.runs_dir() / spec.dag_id / _safe(dag_run_id) / f"segment-{segment:03d}"


def _lineage():  # noqa: ANN202 - imported lazily: DAG parsing must not import MLflow
    from relay.lineage import Lineage

    return Lineage.from_settings()


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
        spec = self.spec()
        policy = self.policy(spec)
        lineage = _lineage()
        nodes = select_nodes(spec.nodes)
        params = {
            "spec_file": self.spec_file,
            "seed": spec.seed,
            "total_steps": spec.total_steps,
            "steps_per_segment": spec.steps_per_segment,
            "checkpoint_every": spec.checkpoint_every,
            "world_size": spec.world_size,
            "policy_file": str(policy.path),
            "policy_sha256": policy.sha256,
        }
        parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id, params)
        log.info(
            "Job %s: %d steps in %d segments on %d nodes x %d ranks (%s); MLflow run %s",
            spec.job, spec.total_steps, len(spec.segments), spec.nodes, spec.ranks_per_node,
            ", ".join(nodes), parent,
        )
        return parent


class TrainSegmentOperator(RelayOperator):
    """Train steps ``[latest checkpoint, segment end)`` on healthy nodes, watched by a trigger."""

    def __init__(self, *, segment: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.segment = segment

    def execute(self, context: Any) -> dict[str, Any] | None:  # noqa: ANN401
        """Launch the segment and defer to the watcher (or do nothing if already past it)."""
        spec = self.spec()
        policy = self.policy(spec)
        index, start, end = spec.segments[self.segment]
        dag_run = context["dag_run"]
        try_number = int(context["ti"].try_number)
        lineage = _lineage()
        parent = lineage.parent_run(spec.job, spec.dag_id, dag_run.run_id)
        seg_dir = segment_dir(spec, dag_run.run_id, index)
        # A task killed mid-segment leaves its workload running: stop it first.
        LocalLauncher().stop_all(seg_dir)
        attempt_dir = seg_dir / f"try-{try_number}"
        latest = lineage.latest_valid_checkpoint(parent, attempt_dir / "resume")
        resume_step = latest.manifest.step if latest else 0
        if resume_step >= end:
            log.info(
                "Segment %d [%d, %d) already done: latest checkpoint is at step %d (%s); no-op",
                index, start, end, resume_step, latest.manifest.ref if latest else "-",
            )
            return {"segment": index, "resumed_from": resume_step, "trained_steps": 0}
        if resume_step != start:
            log.warning(
                "Segment %d starts at step %d, but the latest valid checkpoint is at step %d; "
                "resuming from there", index, start, resume_step,
            )
        nodes = select_nodes(spec.nodes)
        chaos = list((dag_run.conf or {}).get("chaos", []))
        for fault in chaos:
            try:
                ChaosFault.from_dict(fault)
            except (ValueError, TypeError, AttributeError) as exc:
                raise AirflowException(
                    f"DAG run conf `chaos`: {exc} in {fault!r}. Fix the conf and trigger again."
                ) from exc
        run_id = lineage.attempt_run(
            parent,
            index,
            try_number,
            {
                "segment": index,
                "attempt": try_number,
                "nodes": ",".join(nodes),
                "resume_step": resume_step,
                "end_step": end,
                "world_size": spec.world_size,
                "resume_checkpoint": str(latest.manifest.ref) if latest else "none (step 0)",
            },
        )
        cfg = LaunchConfig(
            job=spec.job,
            seed=spec.seed,
            model=spec.model.model_dump(),
            data=spec.data.model_dump(),
            optimizer=spec.optimizer.model_dump(),
            start_step=resume_step,
            end_step=end,
            checkpoint_every=spec.checkpoint_every,
            nodes=nodes,
            ranks_per_node=spec.ranks_per_node,
            master_addr="127.0.0.1",
            master_port=free_port(),
            tracking_uri=lineage.tracking_uri,
            run_id=run_id,
            attempt_dir=str(attempt_dir),
            attempt=try_number,
            segment=index,
            heartbeat_interval_seconds=spec.heartbeat_interval,
            collective_timeout_seconds=spec.collective_timeout,
            resume=(
                ResumeFrom(
                    path=str(latest.path),
                    sha256=latest.manifest.sha256,
                    run_id=latest.manifest.run_id,
                    step=latest.manifest.step,
                )
                if latest
                else None
            ),
            chaos=chaos,
        )
        LocalLauncher().launch(cfg)
        log.info(
            "Segment %d try %d: steps [%d, %d) on %s; MLflow child run %s; attempt folder %s",
            index, try_number, resume_step, end, ", ".join(nodes), run_id, attempt_dir,
        )
        node_ranks = {n: [cfg.global_rank(n, r) for r in range(spec.ranks_per_node)] for n in nodes}
        # Only the trigger's own arguments survive deferral reliably (``dag.test``
        # drops defer kwargs); execute_complete re-reads the rest from the attempt folder.
        self.defer(
            trigger=SegmentWatchTrigger(
                attempt_dir=str(attempt_dir),
                node_ranks=node_ranks,
                detection=policy.policy.detection.model_dump(),
                heartbeat_interval_seconds=spec.heartbeat_interval,
                poll_interval_seconds=policy.policy.detection.poll_interval,
            ),
            method_name="execute_complete",
        )
        return None

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
        """Stop the workload, record the outcome, and succeed or raise for a retry."""
        attempt_dir = Path(event["attempt_dir"])
        survivors = LocalLauncher().stop(attempt_dir)
        cfg = LaunchConfig.read(attempt_dir / LAUNCH_FILE)
        run_id, resume_step, end_step = cfg.run_id, cfg.start_step, cfg.end_step
        lineage = _lineage()
        status = event.get("status")
        if status == "completed" and not survivors:
            lineage.finish_run(run_id, "completed")
            log.info(
                "Segment %d trained steps [%d, %d) in %.1fs", self.segment, resume_step, end_step,
                time.time() - LocalLauncher.started_at(attempt_dir),
            )
            return {"segment": self.segment, "resumed_from": resume_step,
                    "trained_steps": end_step - resume_step}
        if status == "fault":
            fault = Fault.from_event(event["fault"])
            lineage.log_json(run_id, "fault.json", event["fault"])
            lineage.finish_run(run_id, "fault", {"relay.fault_kind": fault.kind.value})
            detected = fault.detected_at - LocalLauncher.started_at(attempt_dir)
            message = (
                f"Segment {self.segment} fault: {fault.describe()} "
                f"(detected {detected:.1f}s after launch; evidence: "
                f"{json.dumps(fault.evidence, default=str)})"
            )
        elif survivors:
            lineage.finish_run(run_id, "orphans")
            message = f"Segment {self.segment}: processes {survivors} survived SIGKILL"
        else:
            lineage.finish_run(run_id, "watcher_error")
            message = f"Segment {self.segment}: watcher error {event.get('message')}\n" + str(
                event.get("traceback", "")
            )
        log.error("%s. Logs: %s", message, attempt_dir / "logs")
        raise AirflowException(message)


class FinalizeOperator(RelayOperator):
    """Check the checkpoint chain reaches the last step, and close the DAG run's MLflow run."""

    def execute(self, context: Any) -> dict[str, Any]:  # noqa: ANN401
        """Return the final checkpoint and the chain back to step 0."""
        spec = self.spec()
        lineage = _lineage()
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
        summary = {
            "final_checkpoint": str(chain[0].ref),
            "final_step": chain[0].step,
            "chain": [
                {"step": m.step, "run_id": m.run_id, "sha256": m.sha256,
                 "parent": str(m.parent) if m.parent else None}
                for m in chain
            ],
        }
        lineage.log_json(parent, "lineage.json", summary)
        lineage.finish_run(
            parent, "completed",
            {"relay.final_checkpoint": str(chain[0].ref), "relay.final_sha256": chain[0].sha256},
        )
        log.info("Final checkpoint %s; chain of %d checkpoints back to step 0 logged to run %s",
                 chain[0].ref, len(chain), parent)
        return summary
