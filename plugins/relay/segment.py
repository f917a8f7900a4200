"""TrainSegmentOperator: launch a segment on healthy nodes, defer to the watcher, decide.

Nothing survives deferral, so ``execute_complete`` finds the workload again
from the event and the attempt folder. On a fault it asks the policy for a
decision, applies it, records it, and raises: :class:`SegmentFaultError` for
Airflow's retry (with the policy's backoff) or ``AirflowFailException`` when
the policy gives up.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from relay import resume_time
from relay.decide import Decision, decide
from relay.faults import RESCUABLE, Fault, FaultKind
from relay.launchers.local import STANDBY_DIR, LocalLauncher, free_port
from relay.nodes import NodePool, NotEnoughNodesError
from relay.operators import RelayOperator, lineage_store, segment_dir
from relay.policy import LoadedPolicy
from relay.recovery import SegmentFaultError, drain, notify, quarantine
from relay.rescue import publish_rescue, request_rescue
from relay.spec import JobSpec
from relay.triggers import SegmentWatchTrigger
from training.chaos import Fault as ChaosFault
from training.heartbeat import read_heartbeats, write_atomically
from training.launch import LAUNCH_FILE, LaunchConfig, ResumeFrom
from training.standby import STANDBY_TTL_SECONDS

log = logging.getLogger(__name__)


def _fault_message(segment: int, fault: Fault, decision: Decision, lost: int | None) -> str:
    lost_text = "unknown" if lost is None else str(lost)
    return (
        f"Segment {segment} fault: {fault.describe()} "
        f"(evidence: {json.dumps(fault.evidence, default=str)}). "
        f"Decision by {decision.rule} (policy sha256 {decision.policy_sha256[:12]}): "
        f"{decision.action} - {decision.reason}. Lost steps: {lost_text}."
    )


def _local_history(attempt_dir: Path) -> list[FaultKind]:
    """Return the fault kinds earlier attempts of this segment ended in (their decision.json)."""
    kinds = []
    for other in sorted(attempt_dir.parent.glob("try-*/decision.json")):
        if other.parent != attempt_dir:
            try:
                kinds.append(FaultKind(json.loads(other.read_text())["fault"]["kind"]))
            except (OSError, ValueError, KeyError):
                log.warning("Unreadable earlier decision %s; not counted", other)
    return kinds


class TrainSegmentOperator(RelayOperator):
    """Train steps ``[latest checkpoint, segment end)`` on healthy nodes, watched by a trigger."""

    def __init__(self, *, segment: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.segment = segment

    # -- launch ------------------------------------------------------------------

    def _chaos(self, dag_run: Any) -> list[dict[str, Any]]:  # noqa: ANN401
        chaos = list((dag_run.conf or {}).get("chaos", []))
        for fault in chaos:
            try:
                ChaosFault.from_dict(fault)
            except (ValueError, TypeError, AttributeError) as exc:
                raise AirflowFailException(
                    f"DAG run conf `chaos`: {exc} in {fault!r}. Fix the conf and trigger again."
                ) from exc
        return chaos

    def _nodes(self, spec: JobSpec, policy: LoadedPolicy) -> list[str]:
        rules = policy.policy.nodes
        wait = rules.wait_up_to if rules.when_too_few == "wait" else 0.0
        try:
            return NodePool().select(spec.nodes, wait_up_to=wait)
        except NotEnoughNodesError as exc:
            target = policy.policy.escalation.target
            log.error("ESCALATION to %s: %s", target, exc)
            raise AirflowFailException(f"Segment {self.segment}: {exc}") from exc

    def _corrupt(self, lineage: Any, run_id: str, corrupt: list[Any],  # noqa: ANN401
                 policy: LoadedPolicy, history: list[FaultKind]) -> None:
        """Record corrupt checkpoints met on the way to the resume point; obey their rule."""
        for bad in corrupt:
            fault = Fault(FaultKind.CORRUPT_CHECKPOINT, None, None, {
                "summary": f"checkpoint at step {bad.manifest.step} has sha256 "
                f"{bad.actual_sha256[:12]}, its manifest says {bad.manifest.sha256[:12]}",
                "checkpoint": str(bad.manifest.ref)})
            decision = decide(fault, history, policy.policy, policy.sha256)
            lineage.reject_checkpoint(bad.manifest, f"corrupt: {fault.evidence['summary']}")
            lineage.log_json(run_id, f"corrupt-step-{bad.manifest.step:08d}.json",
                             {"fault": fault.to_event()["fault"], "decision": decision.to_dict()})
            log.error("%s; decision %s: %s", fault.describe(), decision.action, decision.reason)
            if not decision.retry:
                message = f"Segment {self.segment}: {fault.describe()}; {decision.reason}"
                if decision.notify:
                    notify(decision, message, policy.policy.escalation.webhook)
                lineage.finish_run(run_id, "fault", {"relay.fault_kind": fault.kind.value})
                raise AirflowFailException(message)

    def execute(self, context: Any) -> dict[str, Any] | None:  # noqa: ANN401
        """Launch the segment and defer to the watcher (or do nothing if already past it)."""
        task_started = time.time()
        spec = self.spec()
        policy = self.policy(spec)
        index, start, end = spec.segments[self.segment]
        dag_run = context["dag_run"]
        try_number = int(context["ti"].try_number)
        chaos = self._chaos(dag_run)
        lineage = lineage_store()
        parent = lineage.parent_run(spec.job, spec.dag_id, dag_run.run_id)
        seg_dir = segment_dir(spec, dag_run.run_id, index)
        # A task killed mid-segment leaves its workload running: stop it first, and close
        # the MLflow runs of such launches so the lineage shows them as abandoned.
        LocalLauncher().stop_all(seg_dir)
        lineage.abandon_running(parent, index)
        attempt_dir = seg_dir / f"try-{try_number}"
        if attempt_dir.exists():
            # The same try number ran before (`airflow tasks test`, or a task killed before
            # Airflow counted a new try): keep its evidence, but never mix its heartbeats in.
            aside = attempt_dir.with_name(f"{attempt_dir.name}.stale-{int(time.time())}")
            attempt_dir.rename(aside)
            log.warning("Moved the earlier run of %s to %s", attempt_dir, aside)
        latest, corrupt = lineage.resume_point(parent, attempt_dir / "resume")
        resume_step = latest.manifest.step if latest else 0
        if resume_step >= end:
            log.info(
                "Segment %d [%d, %d) already done: latest checkpoint is at step %d (%s); no-op",
                index, start, end, resume_step, latest.manifest.ref if latest else "-",
            )
            return {"segment": index, "resumed_from": resume_step, "trained_steps": 0}
        if resume_step != start:
            log.warning("Segment %d starts at step %d; resuming from the latest valid checkpoint "
                        "at step %d", index, start, resume_step)
        nodes = self._nodes(spec, policy)
        run_id = lineage.attempt_run(parent, index, try_number, {
            "segment": index, "attempt": try_number, "nodes": ",".join(nodes),
            "resume_step": resume_step, "end_step": end, "world_size": spec.world_size,
            "resume_checkpoint": str(latest.manifest.ref) if latest else "none (step 0)",
            "policy_sha256": policy.sha256, "attempt_dir": str(attempt_dir),
        })
        history = [FaultKind(k) for k in lineage.segment_faults(parent, index)]
        self._corrupt(lineage, run_id, corrupt, policy, history)
        resume = None
        if latest is not None:
            m = latest.manifest
            resume = ResumeFrom(path=str(latest.path), sha256=m.sha256, run_id=m.run_id,
                                step=m.step)
        cfg = LaunchConfig(
            job=spec.job, seed=spec.seed, model=spec.model.model_dump(),
            data=spec.data.model_dump(), optimizer=spec.optimizer.model_dump(),
            start_step=resume_step, end_step=end, checkpoint_every=spec.checkpoint_every,
            nodes=nodes, ranks_per_node=spec.ranks_per_node, master_addr="127.0.0.1",
            master_port=free_port(), tracking_uri=lineage.tracking_uri, run_id=run_id,
            attempt_dir=str(attempt_dir), attempt=try_number, segment=index,
            heartbeat_interval_seconds=spec.heartbeat_interval,
            collective_timeout_seconds=spec.collective_timeout, resume=resume, chaos=chaos,
        )
        launch_called = time.time()
        LocalLauncher().launch(cfg, standby_dir=seg_dir / STANDBY_DIR)
        resume_time.note_launch(attempt_dir, task_started, launch_called)
        log.info("Segment %d try %d: steps [%d, %d) on %s; MLflow child run %s; attempt folder %s",
                 index, try_number, resume_step, end, ", ".join(nodes), run_id, attempt_dir)
        node_ranks = {n: [cfg.global_rank(n, r) for r in range(spec.ranks_per_node)] for n in nodes}
        detection = policy.policy.detection
        # Only the trigger's own arguments survive deferral reliably (``dag.test``
        # drops defer kwargs); execute_complete re-reads the rest from the attempt folder.
        self.defer(
            trigger=SegmentWatchTrigger(
                attempt_dir=str(attempt_dir), node_ranks=node_ranks,
                detection=detection.model_dump(),
                heartbeat_interval_seconds=spec.heartbeat_interval,
                poll_interval_seconds=detection.poll_interval,
            ),
            method_name="execute_complete",
        )
        return None

    # -- decide --------------------------------------------------------------------

    def _prestart(self, spec: JobSpec, decision: Decision, seg_dir: Path) -> None:
        """Have the retry's node agents preload while this attempt is wound down."""
        out = {decision.quarantine_node} if decision.quarantine_node else set()
        nodes = [n for n in NodePool().healthy() if n not in out][: spec.nodes]
        if len(nodes) == spec.nodes:  # else the retry waits for nodes: nothing to warm up
            # They wait out the backoff too, and leave by themselves if the retry never comes.
            ttl = decision.backoff_seconds + STANDBY_TTL_SECONDS
            LocalLauncher().prestart(seg_dir / STANDBY_DIR, nodes, ttl)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
        """Stop the workload, decide per policy, record, and succeed or raise."""
        woke = time.time()
        attempt_dir = Path(event["attempt_dir"])
        cfg = LaunchConfig.read(attempt_dir / LAUNCH_FILE)
        lineage = lineage_store()
        status = event.get("status")
        if status == "completed":
            survivors = LocalLauncher().stop(attempt_dir)
            if not survivors:
                lineage.finish_run(cfg.run_id, "completed")
                self._complete_resume_time(attempt_dir, lineage)
                log.info("Segment %d trained steps [%d, %d) in %.1fs", self.segment,
                         cfg.start_step, cfg.end_step,
                         time.time() - LocalLauncher.started_at(attempt_dir))
                return {"segment": self.segment, "resumed_from": cfg.start_step,
                        "trained_steps": cfg.end_step - cfg.start_step}
            lineage.finish_run(cfg.run_id, "orphans")
            raise AirflowException(f"Segment {self.segment}: processes {survivors} survived")
        if status != "fault":
            LocalLauncher().stop(attempt_dir)
            lineage.finish_run(cfg.run_id, "watcher_error")
            raise AirflowException(f"Segment {self.segment}: watcher error "
                                   f"{event.get('message')}\n{event.get('traceback', '')}")
        return self._on_fault(context, Fault.from_event(event["fault"]), attempt_dir, cfg, lineage,
                              woke)

    @staticmethod
    def _complete_resume_time(attempt_dir: Path, lineage: Any) -> None:  # noqa: ANN401
        """Finish the time-to-resume breakdown of the recovery that started this attempt."""
        try:
            done = resume_time.complete_previous(attempt_dir)
            if done is not None:
                previous, result = done
                run_id = LaunchConfig.read(previous / LAUNCH_FILE).run_id
                resume_time.log_to_mlflow(lineage, run_id, result)
                log.info("Time to resume after %s: %.1fs", previous, result["total"])
        except Exception:  # noqa: BLE001 - a report must never fail the segment
            log.exception("Could not record the time to resume of the previous attempt")

    def _on_fault(self, context: Any, fault: Fault, attempt_dir: Path,  # noqa: ANN401
                  cfg: LaunchConfig, lineage: Any, woke: float) -> dict[str, Any]:  # noqa: ANN401
        clock = resume_time.ResumeClock(resume_time.fault_onset(attempt_dir), fault.detected_at,
                                        woke)
        spec = self.spec()
        policy = self.policy(spec)
        # Decide, drain and stop before touching MLflow: a frozen rank may hold the
        # tracking store's lock (SQLite) until its process is gone.
        decision = decide(fault, _local_history(attempt_dir), policy.policy, policy.sha256)
        if decision.retry:
            self._prestart(spec, decision, attempt_dir.parent)
        clock.mark("decide", time.time())
        beats = read_heartbeats(attempt_dir / "heartbeats")
        progress = max((b.step for b in beats.values()), default=cfg.start_step)
        drained = rescued = None
        if decision.checkpoint_first:
            drained = drain(attempt_dir, policy.policy.detection.checkpoint_timeout)
        elif decision.retry and not decision.rollback and fault.kind in RESCUABLE:
            rescued = request_rescue(attempt_dir, cfg, fault,
                                     policy.policy.detection.checkpoint_timeout)
        clock.mark("rescue", time.time())
        survivors = LocalLauncher().stop(attempt_dir)
        clock.mark("stop", time.time())
        quarantine(decision, fault, f"{spec.dag_id}/{context['dag_run'].run_id}")
        parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id)
        with tempfile.TemporaryDirectory() as tmp:
            latest, _ = lineage.resume_point(parent, Path(tmp))
            if decision.rollback and latest is not None:
                lineage.reject_checkpoint(latest.manifest, f"rollback after {fault.describe()}")
                latest, _ = lineage.resume_point(parent, Path(tmp))
        next_resume = drained if drained is not None else (latest.manifest.step if latest else 0)
        rescue_record = None
        if rescued is not None and rescued.step is not None and rescued.step > next_resume:
            manifest = publish_rescue(rescued, cfg, fault, latest.manifest.ref if latest else None)
            next_resume = manifest.step
            rescue_record = {"rank": rescued.rank, "step": manifest.step,
                             "sha256": manifest.sha256, "seconds": round(rescued.seconds, 3),
                             "checkpoint": str(manifest.ref)}
        lost = max(progress - next_resume, 0)
        record = {"fault": fault.to_event()["fault"], "decision": decision.to_dict(),
                  "progress_step": progress, "next_resume_step": next_resume,
                  "lost_steps": lost, "drained_at_step": drained, "rescued": rescue_record,
                  "survivors": survivors, "time_to_resume": clock.to_dict(),
                  "policy_file": str(policy.path)}
        # Next to the attempt's logs for whoever is on call, and in MLflow for the record.
        write_atomically(attempt_dir / "decision.json", json.dumps(record, indent=2, default=str))
        lineage.log_json(cfg.run_id, "fault.json", record["fault"])
        lineage.log_json(cfg.run_id, "decision.json", record)
        lineage.finish_run(cfg.run_id, "fault", {
            "relay.fault_kind": fault.kind.value, "relay.decision": decision.action,
            "relay.rule": decision.rule, "relay.policy_sha256": decision.policy_sha256,
            "relay.culprit_node": str(fault.culprit_node), "relay.lost_steps": str(lost),
            "relay.culprit_rank": str(fault.culprit_rank),
        })
        clock.mark("record", time.time())  # the retry's task completes the breakdown
        record["time_to_resume"] = clock.to_dict()
        write_atomically(attempt_dir / "decision.json", json.dumps(record, indent=2, default=str))
        self._complete_resume_time(attempt_dir, lineage)  # off this recovery's critical path
        message = _fault_message(self.segment, fault, decision, lost)
        log.error("%s Logs: %s", message, attempt_dir / "logs")
        if decision.retry:
            raise SegmentFaultError(message, decision)
        if decision.notify:
            notify(decision, message, policy.policy.escalation.webhook)
        raise AirflowFailException(message)
