"""TrainSegmentOperator: launch a segment on healthy nodes, defer to the watcher, decide.

Nothing survives deferral, so ``execute_complete`` finds the workload again
from the event and the attempt folder. On a fault it asks the policy for a
decision, applies it, records it, and raises: :class:`SegmentFaultError` for
Airflow's retry (with the policy's backoff) or ``AirflowFailException`` when
the policy gives up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from relay import adopt, journal, resume_time, testhooks, unattended
from relay.chaosconf import ChaosConfError, chaos_faults
from relay.decide import Decision, decide
from relay.drain import drain
from relay.evidence import ask_for_evidence, attach_evidence, collect_evidence
from relay.faults import RESCUABLE, Fault, FaultKind
from relay.interval import interval_for
from relay.launchers import Launcher, LaunchState, launcher_for
from relay.launchers.local import STANDBY_DIR, free_port
from relay.nodes import NodePool, NotEnoughNodesError
from relay.notify import escalate
from relay.observe import ENDS_ATTEMPT, log_observations, record_observation, watched_kinds
from relay.operators import RelayOperator, lineage_store, segment_dir
from relay.policy import LoadedPolicy
from relay.record import best_effort, record_fault
from relay.recovery import SegmentFaultError, fault_history, quarantine
from relay.rescue import publish_rescue, request_rescue
from relay.spec import JobSpec
from relay.triggers import SegmentWatchTrigger
from relay_train.heartbeat import write_atomically
from relay_train.launch import LAUNCH_FILE, LaunchConfig
from relay_train.standby import STANDBY_TTL_SECONDS

log = logging.getLogger(__name__)


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


class TrainSegmentOperator(RelayOperator):
    """Train steps ``[latest checkpoint, segment end)`` on healthy nodes, watched by a trigger."""

    def __init__(self, *, segment: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.segment = segment

    # -- launch ------------------------------------------------------------------

    def _chaos(self, dag_run: Any, spec: JobSpec) -> list[dict[str, Any]]:  # noqa: ANN401
        try:
            return chaos_faults(dag_run.conf, spec, Path(self.spec_file))
        except ChaosConfError as exc:
            raise AirflowFailException(str(exc)) from exc

    def _nodes(self, spec: JobSpec, policy: LoadedPolicy, holder: str | None = None) -> list[str]:
        rules = policy.policy.nodes
        wait = rules.wait_up_to if rules.when_too_few == "wait" else 0.0
        try:
            return NodePool().select(spec.nodes, wait_up_to=wait, holder=holder)
        except NotEnoughNodesError as exc:
            message = f"Segment {self.segment} of {spec.dag_id}: {exc}"
            escalate(policy.policy.escalation.target, message, policy.policy.escalation,
                     {"reason": "not_enough_nodes", "policy_sha256": policy.sha256})
            raise AirflowFailException(message) from exc

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

    def execute(self, context: Any) -> dict[str, Any] | None:  # noqa: ANN401
        """Launch the segment (or adopt the running workload) and defer to the watcher,
        or do nothing if already past it."""
        task_started = time.time()
        spec = self.spec()
        with self._freeze_guard(context, spec, self.segment):
            return self._execute(context, task_started)

    def _freeze_guard(self, context: Any, spec: JobSpec, index: int) -> Any:  # noqa: ANN401
        """Guard MLflow calls made while an earlier segment's workload runs unwatched."""
        run_dir = segment_dir(spec, context["dag_run"].run_id, self.segment).parent
        silent = self.policy(spec).policy.detection.heartbeat_timeout
        return adopt.freeze_guard(run_dir, index, launcher_for(spec), silent)

    def _execute(self, context: Any, task_started: float) -> dict[str, Any] | None:  # noqa: ANN401
        spec = self.spec()
        policy = self.policy(spec)
        index, start, end = spec.segments[self.segment]
        dag_run = context["dag_run"]
        try_number = int(context["ti"].try_number)
        chaos = self._chaos(dag_run, spec)
        lineage = lineage_store()
        parent = lineage.parent_run(spec.job, spec.dag_id, dag_run.run_id)
        seg_dir = segment_dir(spec, dag_run.run_id, index)
        launcher = launcher_for(spec)
        # A try killed while stopping and recording a fault: finish that record first.
        journal.finish_interrupted(context, seg_dir, lambda fault, where, cfg: self._on_fault(
            context, fault, where, cfg, lineage, launcher))
        # A task killed mid-segment leaves its workload running: stop it first, and close
        # the MLflow runs of such launches so the lineage shows them as abandoned.
        launcher.stop_all(seg_dir)
        adopt.stop_adopted(seg_dir, launcher)
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
        adopting = adopt.enabled(spec, launcher)
        if adopting and self._adopt(spec, policy, lineage, parent, attempt_dir, latest, corrupt,
                                    try_number, task_started, launcher):
            return None
        if resume_step >= end:
            log.info(
                "Segment %d [%d, %d) already done: latest checkpoint is at step %d (%s); no-op",
                index, start, end, resume_step, latest.manifest.ref if latest else "-",
            )
            if index == len(spec.segments) - 1:  # a workload that trained it ends by itself
                adopt.wait_for_end(seg_dir.parent, index, launcher)
            return {"segment": index, "resumed_from": resume_step, "trained_steps": 0}
        if resume_step != start:
            log.warning("Segment %d starts at step %d; resuming from the latest valid checkpoint "
                        "at step %d", index, start, resume_step)
        holder = _lease_holder(spec.dag_id, dag_run.run_id)
        nodes = launcher.slots(self._nodes(spec, policy, holder=holder))
        interval = interval_for(spec, lineage)  # checkpoint_every: auto reads the job's record
        run_id = lineage.attempt_run(parent, index, try_number, {**interval.params(),
            "segment": index, "attempt": try_number, "nodes": ",".join(nodes),
            "resume_step": resume_step, "end_step": end, "world_size": spec.world_size,
            "resume_checkpoint": str(latest.manifest.ref) if latest else "none (step 0)",
            "policy_sha256": policy.sha256, "attempt_dir": str(attempt_dir),
        })
        interval.record(attempt_dir)
        history = fault_history(seg_dir, exclude=attempt_dir)
        self._corrupt(lineage, run_id, corrupt, policy, history)
        resume = latest.resume_from() if latest is not None else None
        boundaries, run_on_to = adopt.lookahead(spec, index) if adopting else ([], None)
        cfg = LaunchConfig(
            job=spec.job, seed=spec.seed, model=spec.model.model_dump(),
            data=spec.data.model_dump(), optimizer=spec.optimizer.model_dump(),
            start_step=resume_step, end_step=end, checkpoint_every=interval.steps,
            nodes=nodes, ranks_per_node=spec.ranks_per_node, master_addr="127.0.0.1",
            master_port=free_port(), tracking_uri=lineage.tracking_uri, run_id=run_id,
            attempt_dir=str(attempt_dir), attempt=try_number, segment=index,
            heartbeat_interval_seconds=spec.heartbeat_interval,
            collective_timeout_seconds=spec.collective_timeout, resume=resume, chaos=chaos,
            entrypoint=spec.launch_entrypoint(Path(self.spec_file)), backend=spec.backend,
            deterministic=spec.deterministic, boundaries=boundaries, run_on_to=run_on_to,
        )
        launch_called = time.time()
        launcher.launch(cfg, standby_dir=seg_dir / STANDBY_DIR)
        journal.write(context, seg_dir, journal.LAUNCHED, attempt_dir=str(attempt_dir),
                      run_id=run_id, nodes=nodes)
        resume_time.note_launch(attempt_dir, task_started, launch_called)
        log.info("Segment %d try %d: steps [%d, %d) on %s; MLflow child run %s; attempt folder %s",
                 index, try_number, resume_step, end, ", ".join(nodes), run_id, attempt_dir)
        self._watch(attempt_dir, cfg, policy, launcher, boundary=adopt.watch_boundary(cfg, cfg))
        return None

    def _adopt(self, spec: JobSpec, policy: LoadedPolicy, lineage: Any,  # noqa: ANN401
               parent: str, attempt_dir: Path, latest: Any, corrupt: list[Any],  # noqa: ANN401
               try_number: int, task_started: float, launcher: Launcher) -> bool:
        """Adopt the workload an earlier segment left running, if it may be; see relay.adopt."""
        index, _start, end = spec.segments[self.segment]
        workload = adopt.live_workload(attempt_dir.parent.parent, index, launcher)
        if workload is None:
            return False
        resume_step = latest.manifest.step if latest else 0
        why = adopt.refusal(workload, end, resume_step)
        held = sorted(set(LaunchConfig.read(workload / LAUNCH_FILE).nodes)
                      - set(NodePool().healthy())) if why is None else []
        if held:
            why = f"node(s) {', '.join(held)} are quarantined now"
        if why is not None and resume_step >= end:
            return False  # nothing to train here: leave it be (a later segment may adopt it)
        if why is not None:
            log.warning("Not adopting the workload %s: %s. Stopping it and launching afresh",
                        workload, why)
            launcher.stop(workload)
            adopt.let_go(workload)
            return False
        cfg = LaunchConfig.read(workload / LAUNCH_FILE)
        run_id = lineage.attempt_run(parent, index, try_number, {
            "segment": index, "attempt": try_number, "nodes": ",".join(cfg.nodes),
            "resume_step": resume_step, "end_step": end, "world_size": spec.world_size,
            "resume_checkpoint": str(latest.manifest.ref) if latest else "none (step 0)",
            "policy_sha256": policy.sha256, "attempt_dir": str(attempt_dir),
            "adopted_workload": str(workload),
        })
        self._corrupt(lineage, run_id, corrupt, policy,
                      fault_history(attempt_dir.parent, exclude=attempt_dir))
        _ends, next_end = adopt.lookahead(spec, index)
        at = adopt.adopt(attempt_dir, workload, run_id=run_id, segment=index,
                         attempt=try_number, resume_step=resume_step, end=end,
                         next_end=next_end)
        lineage.set_tags(run_id, {"relay.adopted_at_step": str(at)})
        resume_time.note_launch(attempt_dir, task_started, time.time())
        view = adopt.attempt_view(attempt_dir, cfg)
        self._watch(workload, cfg, policy, launcher, boundary=adopt.watch_boundary(view, cfg))
        return True  # not reached: _watch defers

    def _watch(self, attempt_dir: Path, cfg: LaunchConfig, policy: LoadedPolicy,
               launcher: Launcher, kinds: list[str] | None = None,
               boundary: int | None = None) -> None:
        """Defer to the watcher (``kinds``: the fault kinds to watch; None: all; ``boundary``:
        the step whose passing completes the segment while its workload trains on)."""
        node_ranks = {n: [cfg.global_rank(n, r) for r in range(cfg.ranks_per_node)]
                      for n in cfg.nodes}
        detection = policy.policy.detection
        history = fault_history(attempt_dir.parent, exclude=attempt_dir)
        # Only the trigger's own arguments survive deferral reliably (``dag.test``
        # drops defer kwargs); execute_complete re-reads the rest from the attempt folder.
        self.defer(
            trigger=SegmentWatchTrigger(
                attempt_dir=str(attempt_dir), node_ranks=node_ranks,
                detection=detection.model_dump(),
                heartbeat_interval_seconds=cfg.heartbeat_interval_seconds,
                poll_interval_seconds=detection.poll_interval, kinds=kinds,
                launcher=launcher.config(), boundary_step=boundary,
                unattended=unattended.plan(policy.policy, history, policy.sha256),
            ),
            method_name="execute_complete",
        )

    # -- decide --------------------------------------------------------------------

    def _prestart(self, spec: JobSpec, decision: Decision, seg_dir: Path, holder: str,
                  launcher: Launcher) -> None:
        """Have the retry's node agents preload while this attempt is wound down."""
        out = {decision.quarantine_node} if decision.quarantine_node else set()
        nodes = [n for n in NodePool().available(holder) if n not in out][: spec.nodes]
        if len(nodes) == spec.nodes:  # else the retry waits for nodes: nothing to warm up
            # They wait out the backoff too, and leave by themselves if the retry never comes.
            ttl = decision.backoff_seconds + STANDBY_TTL_SECONDS
            launcher.prestart(seg_dir / STANDBY_DIR, launcher.slots(nodes), ttl)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
        """Stop the workload, decide per policy, record, and succeed or raise.

        However the attempt ends, its nodes' lease ends with it (not when it defers again).
        """
        watching = False
        self._workload_continues = False  # handed over at a boundary: its nodes stay leased
        try:
            return self._complete(context, event)
        except TaskDeferred:
            watching = True
            raise
        finally:
            if not watching and not self._workload_continues:
                NodePool().release_lease(_lease_holder(self.spec().dag_id,
                                                       context["dag_run"].run_id))

    def _complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
        woke = time.time()  # the deferred task runs again (time to resume: wake)
        attempt_dir = Path(event["attempt_dir"])  # where the workload runs
        spec = self.spec()
        # This try's own folder: the attempt folder, or where it recorded an adoption.
        record_dir = segment_dir(spec, context["dag_run"].run_id, self.segment) / (
            f"try-{int(context['ti'].try_number)}")
        if adopt.read_adopted(record_dir) is None:
            record_dir = attempt_dir
        cfg = adopt.attempt_view(record_dir, LaunchConfig.read(attempt_dir / LAUNCH_FILE))
        lineage = lineage_store()
        launcher = launcher_for(spec)
        status = event.get("status")
        if event.get("refused"):  # messages from agents of another attempt (fencing)
            log.warning("Refused %d message source(s) of other attempts while watching: %s",
                        len(event["refused"]), event["refused"])
            best_effort("record the refused messages", lambda: lineage.log_json(
                cfg.run_id, "refused.json", event["refused"]))
        if status == "completed" and event.get("boundary_step") is not None:
            with self._freeze_guard(context, spec, self.segment + 1):
                parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id)
                return self._handed_over(event, record_dir, attempt_dir, cfg, lineage, launcher,
                                         woke, parent)
        if status == "completed":
            survivors = launcher.stop(attempt_dir)
            adopt.let_go(attempt_dir)
            best_effort("log the observations",
                        lambda: log_observations(lineage, cfg.run_id, record_dir))
            if not survivors:
                lineage.finish_run(cfg.run_id, "completed")
                adopt.note_boundary(record_dir, event.get("at"), woke)
                self._complete_resume_time(record_dir, lineage)
                log.info("Segment %d trained steps [%d, %d) in %.1fs", self.segment,
                         cfg.start_step, cfg.end_step,
                         time.time() - launcher.started_at(attempt_dir))
                return {"segment": self.segment, "resumed_from": cfg.start_step,
                        "trained_steps": cfg.end_step - cfg.start_step}
            lineage.finish_run(cfg.run_id, "orphans")
            raise AirflowException(f"Segment {self.segment}: processes {survivors} survived")
        if status != "fault":
            launcher.stop(attempt_dir)
            adopt.let_go(attempt_dir)
            lineage.finish_run(cfg.run_id, "watcher_error")
            raise AirflowException(f"Segment {self.segment}: watcher error "
                                   f"{event.get('message')}\n{event.get('traceback', '')}")
        return self._on_fault(context, Fault.from_event(event["fault"]), attempt_dir, cfg, lineage,
                              launcher, woke, refused=event.get("refused"), record_dir=record_dir)

    def _handed_over(self, event: dict[str, Any], record_dir: Path, workload: Path,
                     cfg: LaunchConfig, lineage: Any, launcher: Launcher,  # noqa: ANN401
                     woke: float, parent: str) -> dict[str, Any]:
        """Every rank passed this segment's end: succeed once its checkpoint is in MLflow,
        and leave the workload training for the next segment's task to adopt."""
        step = int(event["boundary_step"])
        timeout = self.policy(self.spec()).policy.detection.checkpoint_timeout
        if not adopt.wait_published(lineage, parent, cfg.run_id, step, timeout):
            launcher.stop(workload)
            adopt.let_go(workload)
            lineage.finish_run(cfg.run_id, "no_checkpoint")
            raise AirflowException(
                f"Segment {self.segment}: every rank passed step {step}, but its checkpoint "
                f"was not in MLflow within {timeout:g}s (detection.checkpoint_timeout); the "
                "workload was stopped and the retry resumes from the latest checkpoint")
        best_effort("log the observations",
                    lambda: log_observations(lineage, cfg.run_id, record_dir))
        lineage.finish_run(cfg.run_id, "completed", {"relay.handed_over_at_step": str(step)})
        self._complete_resume_time(record_dir, lineage)
        adopt.note_boundary(record_dir, event.get("at"), woke)
        self._workload_continues = True
        log.info("Segment %d trained steps [%d, %d); its checkpoint at step %d is in MLflow and "
                 "the workload %s trains on, for the next segment to adopt", self.segment,
                 cfg.start_step, cfg.end_step, step, workload)
        return {"segment": self.segment, "resumed_from": cfg.start_step,
                "trained_steps": cfg.end_step - cfg.start_step, "handed_over": str(workload)}

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
        history = fault_history(record_dir.parent, exclude=record_dir)
        decision = decide(fault, history, policy.policy, policy.sha256)
        if decision.quarantine_node:  # a quarantine names the machine, not the node's slot
            host = launcher.host_of(attempt_dir, decision.quarantine_node)
            decision = dataclasses.replace(decision, quarantine_node=host)
        if decision.observe:
            return self._observe(context, fault, decision, attempt_dir, cfg, lineage, policy,
                                 launcher, record_dir)
        journal.write(context, record_dir.parent, journal.HANDLING,
                      attempt_dir=str(attempt_dir), fault=fault.to_event()["fault"])
        if decision.retry:
            self._prestart(spec, decision, record_dir.parent,
                           _lease_holder(spec.dag_id, context["dag_run"].run_id), launcher)
        clock.mark("decide", time.time())
        beats = launcher.status(attempt_dir).heartbeats  # over the channel, not from files
        progress = max((b.step for b in beats.values()), default=cfg.start_step)
        # Did the watcher's warden stop it already (no one resumed the task in time)?
        detection = policy.policy.detection
        warden = unattended.take_over(attempt_dir, detection.checkpoint_timeout + 30)
        if warden is not None:
            asked, drained, rescued = unattended.results(warden, decision, fault, attempt_dir)
        else:
            # Where is it stuck? Ask every rank now (after the stop nobody answers); the
            # answers arrive while the rescue runs and are gathered, bounded, before the stop.
            asked = ask_for_evidence(attempt_dir, fault, cfg.world_size, launcher)
            drained = rescued = None
            if decision.checkpoint_first:
                drained = drain(attempt_dir, detection.checkpoint_timeout, launcher)
            elif decision.retry and not decision.rollback and fault.kind in RESCUABLE:
                rescued = request_rescue(attempt_dir, cfg, fault, detection.checkpoint_timeout,
                                         launcher)
        evidence = (collect_evidence(asked, policy.policy.detection.evidence_timeout)
                    if asked else None)
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
        if evidence is not None:  # into fault.json only: the task log's message stays one line
            attach_evidence(record["fault"], evidence, lineage, cfg.run_id)
        # Next to the attempt's logs for whoever is on call, and in MLflow for the record.
        write_atomically(record_dir / "decision.json", json.dumps(record, indent=2, default=str),
                         durable=True)
        record_fault(lineage, cfg.run_id, record_dir, record, {
            "relay.fault_kind": fault.kind.value, "relay.decision": decision.action,
            "relay.rule": decision.rule, "relay.policy_sha256": decision.policy_sha256,
            "relay.culprit_node": str(fault.culprit_node), "relay.lost_steps": str(lost),
            "relay.culprit_rank": str(fault.culprit_rank),
        })
        clock.mark("record", time.time())  # the retry's task completes the breakdown
        record["time_to_resume"] = clock.to_dict()
        write_atomically(record_dir / "decision.json", json.dumps(record, indent=2, default=str),
                         durable=True)
        journal.write(context, record_dir.parent, journal.RECORDED, attempt_dir=str(attempt_dir))
        self._complete_resume_time(record_dir, lineage)  # off this recovery's critical path
        log.error("%s Logs: %s", message, attempt_dir / "logs")
        if decision.retry:
            raise SegmentFaultError(message, decision)
        raise AirflowFailException(message)

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
        state = launcher.status(attempt_dir).state
        if state is LaunchState.RUNNING and fault.kind not in ENDS_ATTEMPT:
            workload = LaunchConfig.read(attempt_dir / LAUNCH_FILE)
            self._watch(attempt_dir, workload, policy, launcher, kinds=watched_kinds(record_dir),
                        boundary=adopt.watch_boundary(cfg, workload))
        if state is LaunchState.SUCCEEDED:
            return self._complete(context, {"status": "completed",
                                            "attempt_dir": str(attempt_dir)})
        # The processes are gone (a crash ends the job, observed or not): record and fail.
        survivors = launcher.stop(attempt_dir)
        adopt.let_go(attempt_dir)
        write_atomically(record_dir / "decision.json", json.dumps(
            {**record, "survivors": survivors}, indent=2, default=str), durable=True)
        record_fault(lineage, cfg.run_id, record_dir, record, {
            "relay.fault_kind": fault.kind.value, "relay.decision": decision.action,
            "relay.rule": decision.rule, "relay.policy_sha256": decision.policy_sha256,
            "relay.mode": "observe", "relay.culprit_node": str(fault.culprit_node),
            "relay.culprit_rank": str(fault.culprit_rank),
        })
        raise AirflowFailException(message)
