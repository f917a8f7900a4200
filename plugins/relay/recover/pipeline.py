"""The fault path of a segment task: decide, save what can be saved, stop, fence, record.

:class:`FaultHandling` is mixed into :class:`relay.operators.segment.TrainSegmentOperator`;
``execute_complete`` hands it a fault from the watcher. It decides per policy
before touching MLflow (a frozen rank may hold the tracking store's lock),
asks for stacks and a drain or a rescue while the ranks still answer, stops
and fences the attempt, finds the resume point, records the decision next to
the attempt and in MLflow, and raises: :class:`SegmentFaultError` for
Airflow's retry or ``AirflowFailException`` when the policy gives up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from relay.core import testhooks
from relay.core.faults import RESCUABLE, Fault, FaultKind
from relay.launchers import Launcher, LaunchState, launch_record, launcher_for
from relay.launchers.local import adopt
from relay.launchers.local.launcher import STANDBY_DIR
from relay.lineage import resume_time
from relay.nodes.pool import NodePool
from relay.operators.base import lineage_store
from relay.policy.decide import Decision, decide
from relay.policy.model import Detection, LoadedPolicy
from relay.policy.notify import escalate
from relay.policy.observe import ENDS_ATTEMPT, record_observation, watched_kinds
from relay.recover import journal, warden_results
from relay.recover import warden as unattended
from relay.recover.ask_rescue import publish_rescue, request_rescue, silent
from relay.recover.drain import drain
from relay.recover.evidence import Evidence, ask_for_evidence, attach_evidence, collect_evidence
from relay.recover.outcome import SegmentFaultError, quarantine
from relay.recover.record import best_effort, record_fault
from relay.spec.job import JobSpec
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.launch import LaunchConfig
from relay_train.protocol.routes import STANDBY_TTL_SECONDS

log = logging.getLogger("relay.operators.segment")


def _lease_holder(dag_id: str, dag_run_id: str) -> str:
    """Return who holds a DAG run's node leases."""
    return f"{dag_id}/{dag_run_id}"


def _fault_message(segment: int, fault: Fault, decision: Decision, lost: int | None) -> str:
    lost_text = "unknown" if lost is None else str(lost)
    return (
        f"Segment {segment} fault: {fault.describe()} "
        f"(evidence: {json.dumps(fault.evidence, default=str)}). "
        f"Decision by {decision.rule} (policy sha256 {decision.policy_sha256[:12]}): "
        f"{decision.action} - {decision.reason}. Lost steps: {lost_text}."
    )


class FaultHandling:
    """What :class:`~relay.operators.segment.TrainSegmentOperator` does with a fault (a mixin)."""

    segment: int
    _task_context: Any = None  # set by execute / execute_complete

    def _history(self, segment_dir: Path, exclude: Path | None = None) -> list[FaultKind]:
        """Return the faults earlier attempts of this task ended in (see relay.recover.journal)."""
        return journal.fault_history(self._task_context or {}, segment_dir, exclude)

    def _corrupt(self, lineage: Any, run_id: str, corrupt: list[Any],  # noqa: ANN401
                 policy: LoadedPolicy, history: list[FaultKind]) -> None:
        """Record corrupt checkpoints met on the way to the resume point; obey their rule."""
        for bad in corrupt:
            fault = Fault(FaultKind.CORRUPT_CHECKPOINT, None, None, {
                "summary": f"checkpoint at step {bad.manifest.step} has sha256 "
                f"{bad.actual_sha256[:12]}, its manifest says {bad.manifest.sha256[:12]}"
                + (f" ({bad.detail})" if bad.detail else ""),
                "checkpoint": str(bad.manifest.ref)})
            decision = decide(fault, history, policy.policy, policy.sha256)
            lineage.reject_checkpoint(bad.manifest, f"corrupt: {fault.evidence['summary']}")
            lineage.log_json(run_id, f"corrupt-step-{bad.manifest.step:08d}.json",
                             {"fault": fault.to_event()["fault"], "decision": decision.to_dict()})
            log.error("%s; decision %s: %s", fault.describe(), decision.action, decision.reason)
            if not decision.retry:
                message = f"Segment {self.segment}: {fault.describe()}; {decision.reason}"
                if decision.notify:
                    escalate(decision.notify, message, policy.policy.escalation,
                             {"decision": decision.to_dict()})
                lineage.finish_run(run_id, "fault", {"relay.fault_kind": fault.kind.value})
                raise AirflowFailException(message)

    def _prestart(self, spec: JobSpec, decision: Decision, seg_dir: Path, holder: str,
                  launcher: Launcher, attempt_dir: Path) -> None:
        """Have the retry's node agents preload while this attempt is wound down (the
        agents of ``attempt_dir`` that still answer hand on copies of themselves)."""
        out = {decision.quarantine_node} if decision.quarantine_node else set()
        nodes = NodePool().next_lease(holder, spec.nodes, out)
        if nodes:  # else the retry waits for nodes: nothing to warm up
            # They wait out the backoff too, and leave by themselves if the retry never comes.
            ttl = decision.backoff_seconds + STANDBY_TTL_SECONDS
            launcher.prestart(seg_dir / STANDBY_DIR, launcher.slots(nodes), ttl,
                              source=attempt_dir)

    def _on_fault(self, context: Any, fault: Fault, attempt_dir: Path,  # noqa: ANN401
                  cfg: LaunchConfig, lineage: Any,  # noqa: ANN401
                  launcher: Launcher | None = None, woke: float | None = None,
                  refused: list[dict[str, Any]] | None = None,
                  record_dir: Path | None = None) -> dict[str, Any]:
        """Decide and apply the policy; ``woke``: when the task ran again (default: now).

        ``attempt_dir`` is where the workload runs; ``record_dir`` this try's own folder
        (they differ when the try adopted a workload an earlier segment launched).
        ``refused``: messages the watcher refused from agents of another attempt (fencing).
        """
        record_dir = record_dir or attempt_dir
        if record_dir != attempt_dir:
            adopt.copy_strikes(attempt_dir, record_dir)
        clock = resume_time.ResumeClock(resume_time.fault_onset(record_dir), fault.detected_at,
                                        time.time() if woke is None else woke)
        spec = self.spec()
        policy = self.policy(spec)
        launcher = launcher or launcher_for(spec)
        # Decide, drain and stop before touching MLflow: a frozen rank may hold the
        # tracking store's lock (SQLite) until its process is gone.
        history = journal.fault_history(context, record_dir.parent, exclude=record_dir)
        decision = decide(fault, history, policy.policy, policy.sha256)
        if decision.quarantine_node:  # a quarantine names the machine, not the node's slot
            host = launcher.host_of(attempt_dir, decision.quarantine_node)
            decision = dataclasses.replace(decision, quarantine_node=host)
        if decision.observe:
            return self._observe(context, fault, decision, attempt_dir, cfg, lineage, policy,
                                 launcher, record_dir)
        journal.write(context, record_dir.parent, journal.HANDLING,
                      attempt_dir=str(attempt_dir), record_dir=str(record_dir),
                      fault=fault.to_event()["fault"],
                      **{launch_record.KEY: launch_record.build(
                          launch_record.config_of(attempt_dir, cfg), launcher)})
        launcher.channel(attempt_dir).mark_silent(silent(fault, cfg)[0])
        if decision.retry:
            self._prestart(spec, decision, record_dir.parent,
                           _lease_holder(spec.dag_id, context["dag_run"].run_id), launcher,
                           attempt_dir)
        clock.mark("decide", time.time())
        beats = launcher.status(attempt_dir).heartbeats  # over the channel, not from files
        progress = max((b.step for b in beats.values()), default=cfg.start_step)
        evidence, drained, rescued = self._save_state(attempt_dir, cfg, fault, decision,
                                                      policy.policy.detection, launcher)
        clock.mark("rescue", time.time())
        testhooks.pause("stop", attempt_dir=str(attempt_dir))
        survivors = launcher.stop(attempt_dir)
        adopt.let_go(attempt_dir)
        clock.mark("stop", time.time())
        # Fencing: whatever this attempt's nodes publish from now on (one the stop could
        # not reach, coming back) is refused by the resume chooser.
        fence = f"replaced after {fault.kind.value} (try {cfg.attempt})"
        best_effort("fence the attempt", lambda: lineage.fence_attempt(cfg.run_id, fence))
        testhooks.pause("record", attempt_dir=str(attempt_dir))
        quarantine(decision, fault, f"{spec.dag_id}/{context['dag_run'].run_id}", launcher)
        next_resume, rescue_record = self._next_resume(context, spec, decision, fault, cfg,
                                                       lineage, drained, rescued, fence)
        lost = None if next_resume is None else max(progress - next_resume, 0)
        message = _fault_message(self.segment, fault, decision, lost)
        delivery = None
        if decision.notify:
            delivery = escalate(decision.notify, message, policy.policy.escalation,
                                {"decision": decision.to_dict()}).to_dict()
        record = {"fault": fault.to_event()["fault"], "decision": decision.to_dict(),
                  "progress_step": progress, "next_resume_step": next_resume,
                  "lost_steps": lost, "drained_at_step": drained, "rescued": rescue_record,
                  "survivors": survivors, "notification": delivery,
                  "refused": (refused or []) + launcher.channel(attempt_dir).refused,
                  "time_to_resume": clock.to_dict(),
                  "policy_file": str(policy.path)}
        journal.note_fault(context, record_dir, fault.kind)  # before MLflow, which may hang
        self._record(record, record_dir, cfg, lineage, fault, decision, evidence, clock)
        journal.write(context, record_dir.parent, journal.RECORDED, attempt_dir=str(attempt_dir))
        self._complete_resume_time(record_dir, lineage)  # off this recovery's critical path
        log.error("%s Logs: %s", message, attempt_dir / "logs")
        if decision.retry:
            raise SegmentFaultError(message, decision)
        raise AirflowFailException(message)

    def _record(self, record: dict[str, Any], record_dir: Path, cfg: LaunchConfig,
                lineage: Any, fault: Fault, decision: Decision,  # noqa: ANN401
                evidence: Evidence | None, clock: resume_time.ResumeClock) -> None:
        """Write the decision next to the attempt's logs (for whoever is on call) and in
        MLflow (for the record), then again with the record step's time in its breakdown."""
        if evidence is not None:  # into fault.json only: the task log's message stays one line
            attach_evidence(record["fault"], evidence, lineage, cfg.run_id)
        write_atomically(record_dir / "decision.json", json.dumps(record, indent=2, default=str),
                         durable=True)
        record_fault(lineage, cfg.run_id, record_dir, record, {
            "relay.fault_kind": fault.kind.value, "relay.decision": decision.action,
            "relay.rule": decision.rule, "relay.policy_sha256": decision.policy_sha256,
            "relay.culprit_node": str(fault.culprit_node),
            "relay.lost_steps": str(record["lost_steps"]),
            "relay.culprit_rank": str(fault.culprit_rank),
        }, journal.observations(self._task_context, record_dir))
        clock.mark("record", time.time())  # the retry's task completes the breakdown
        record["time_to_resume"] = clock.to_dict()
        write_atomically(record_dir / "decision.json", json.dumps(record, indent=2, default=str),
                         durable=True)

    @staticmethod
    def _save_state(
        attempt_dir: Path, cfg: LaunchConfig, fault: Fault, decision: Decision,
        detection: Detection, launcher: Launcher,
    ) -> tuple[Evidence | None, int | None, Any]:
        """Ask for stacks, and drain or rescue as decided, before the stop; return
        (evidence, drained step, rescued state). A warden that already stopped the
        attempt (no one resumed the task in time) did this: take its results."""
        warden = unattended.take_over(  # on this machine, or held by a warden elsewhere
            attempt_dir, detection.checkpoint_timeout + 30, launcher,
            lambda: warden_results.fetch(lineage_store(), cfg.run_id, attempt_dir),
            None if detection.stop_unattended_after is None
            else fault.detected_at + detection.stop_unattended_after)
        if warden is not None:
            return unattended.results(warden, decision, fault, attempt_dir)
        # Where is it stuck? Ask every rank now (after the stop nobody answers); the
        # answers arrive while the rescue runs and are gathered, bounded, before the stop.
        asked = ask_for_evidence(attempt_dir, fault, cfg, launcher)
        drained = rescued = None
        if decision.checkpoint_first:
            drained = drain(attempt_dir, detection.checkpoint_timeout, launcher)
        elif decision.retry and not decision.rollback and fault.kind in RESCUABLE:
            rescued = request_rescue(attempt_dir, cfg, fault, detection.checkpoint_timeout,
                                     launcher)
        evidence = collect_evidence(asked, detection.evidence_timeout) if asked else None
        return evidence, drained, rescued

    def _next_resume(self, context: Any, spec: JobSpec, decision: Decision,  # noqa: ANN401
                     fault: Fault, cfg: LaunchConfig, lineage: Any,  # noqa: ANN401
                     drained: int | None, rescued: Any,  # noqa: ANN401
                     fence: str) -> tuple[int | None, dict[str, Any] | None]:
        """Return the step the retry resumes from, publishing a rescued state newer than the
        latest checkpoint (and its record), or None where MLflow could not say."""
        found = best_effort("find the resume point", lambda: self._resume_point(
            context, spec, decision, fault, lineage))
        latest = found[0] if found else None
        next_resume = drained if drained is not None else (
            None if found is None else latest.manifest.step if latest else 0)
        rescue_record = None
        if rescued is not None and rescued.step is not None and found is not None and (
                next_resume is None or rescued.step > next_resume):
            manifest = best_effort("publish the rescued weights", lambda: publish_rescue(
                rescued, cfg, fault, latest.manifest.ref if latest else None))
            if manifest is not None:
                best_effort("accept the rescued state", lambda: lineage.fence_attempt(
                    cfg.run_id, fence, accept=(manifest.ref.artifact_dir.rsplit("/", 1)[-1],)))
                next_resume = manifest.step
                rescue_record = {"rank": rescued.rank, "step": manifest.step,
                                 "sha256": manifest.sha256, "seconds": round(rescued.seconds, 3),
                                 "checkpoint": str(manifest.ref)}
        return next_resume, rescue_record

    def _resume_point(self, context: Any, spec: JobSpec, decision: Decision,  # noqa: ANN401
                      fault: Fault, lineage: Any) -> tuple[Any, list[Any]]:  # noqa: ANN401
        """Return where the next attempt resumes, rolling back first if the decision says so."""
        parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id)
        with tempfile.TemporaryDirectory() as tmp:
            latest, corrupt = lineage.resume_point(parent, Path(tmp))
            if decision.rollback and latest is not None:
                lineage.reject_checkpoint(latest.manifest, f"rollback after {fault.describe()}")
                latest, corrupt = lineage.resume_point(parent, Path(tmp))
        return latest, corrupt

    def _observe(self, context: Any, fault: Fault, decision: Decision,  # noqa: ANN401
                 attempt_dir: Path, cfg: LaunchConfig, lineage: Any,  # noqa: ANN401
                 policy: LoadedPolicy, launcher: Launcher,
                 record_dir: Path | None = None) -> dict[str, Any]:
        """Record and notify what Relay would do; keep watching unless the job has ended."""
        record_dir = record_dir or attempt_dir
        message = "OBSERVE MODE (not applied): " + _fault_message(self.segment, fault, decision,
                                                                  None)
        record = record_observation(record_dir, fault, decision, policy, message)
        journal.note_observation(context, record_dir, record)
        observed = journal.observations(context, record_dir)
        state = launcher.status(attempt_dir).state
        if state is LaunchState.RUNNING and fault.kind not in ENDS_ATTEMPT:
            workload = launch_record.config_of(attempt_dir)
            self._watch(attempt_dir, workload, policy, launcher,
                        kinds=watched_kinds(record_dir, observed),
                        boundary=adopt.watch_boundary(cfg, workload))
        if state is LaunchState.SUCCEEDED:
            return self._complete(context, {"status": "completed",
                                            "attempt_dir": str(attempt_dir)})
        # The processes are gone (a crash ends the job, observed or not): record and fail.
        survivors = launcher.stop(attempt_dir)
        adopt.let_go(attempt_dir)
        write_atomically(record_dir / "decision.json", json.dumps(
            {**record, "survivors": survivors}, indent=2, default=str), durable=True)
        journal.note_fault(context, record_dir, fault.kind)  # counted, as decision.json is
        record_fault(lineage, cfg.run_id, record_dir, record, {
            "relay.fault_kind": fault.kind.value, "relay.decision": decision.action,
            "relay.rule": decision.rule, "relay.policy_sha256": decision.policy_sha256,
            "relay.mode": "observe", "relay.culprit_node": str(fault.culprit_node),
            "relay.culprit_rank": str(fault.culprit_rank),
        }, observed)
        raise AirflowFailException(message)

    @staticmethod
    def _complete_resume_time(attempt_dir: Path, lineage: Any) -> None:  # noqa: ANN401
        """Finish the time-to-resume breakdown of the recovery that started this attempt."""
        try:
            done = resume_time.complete_previous(attempt_dir)
            if done is not None:
                previous, result = done
                run_id = adopt.run_id_of(previous)
                resume_time.log_to_mlflow(lineage, run_id, result)
                log.info("Time to resume after %s: %.1fs", previous, result["total"])
        except Exception:  # noqa: BLE001 - a report must never fail the segment
            log.exception("Could not record the time to resume of the previous attempt")
