"""TrainSegmentOperator: launch a segment on healthy nodes (or adopt the workload the
previous segment handed over), defer to the watcher, and finish or hand over.

Nothing survives deferral, so ``execute_complete`` finds the workload again
from the event: the launch record (config and launcher handle) travels in the
watcher's arguments and comes back in its event, or from the task state store
(:mod:`relay.launchers.launch_record`), never only from the folder ``execute`` wrote.
A fault goes to the policy through :class:`relay.recover.pipeline.FaultHandling`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from relay.core import testhooks
from relay.core.faults import Fault
from relay.launchers import Launcher, launch_record, launcher_for
from relay.launchers.local import adopt, spare
from relay.launchers.local.launcher import STANDBY_DIR, free_port
from relay.lineage import resume_time
from relay.lineage.interval import interval_for
from relay.nodes.pool import NodePool, NotEnoughNodesError
from relay.operators.base import RelayOperator, lineage_store, segment_dir
from relay.policy.model import LoadedPolicy
from relay.policy.notify import escalate
from relay.policy.observe import log_observations
from relay.recover import journal
from relay.recover import warden as unattended
from relay.recover.pipeline import FaultHandling, _lease_holder
from relay.recover.record import best_effort
from relay.spec.chaos_conf import ChaosConfError, chaos_faults
from relay.spec.job import JobSpec
from relay.watch.triggers import SegmentWatchTrigger
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig
from relay_train.protocol.routes import STANDBY_TTL_SECONDS

log = logging.getLogger(__name__)


class TrainSegmentOperator(FaultHandling, RelayOperator):
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

    def execute(self, context: Any) -> dict[str, Any] | None:  # noqa: ANN401
        """Launch the segment (or adopt the running workload) and defer to the watcher,
        or do nothing if already past it."""
        task_started = time.time()
        self._task_context = context  # the task state store, for the fault history
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
        journal.finish_interrupted(context, seg_dir, lambda fault, where, own, cfg: self._on_fault(
            context, fault, where, adopt.attempt_view(own, cfg), lineage, launcher,
            record_dir=own), launcher, lineage.tracking_uri)
        # A task killed mid-segment leaves its workload running: stop it first, and close
        # the MLflow runs of such launches so the lineage shows them as abandoned.
        journal.stop_launched(context, seg_dir, launcher, lineage.tracking_uri)
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
        history = self._history(seg_dir, exclude=attempt_dir)
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
                      run_id=run_id, nodes=nodes,
                      **{launch_record.KEY: launch_record.build(cfg, launcher)})
        resume_time.note_launch(attempt_dir, task_started, launch_called)
        log.info("Segment %d try %d: steps [%d, %d) on %s; MLflow child run %s; attempt folder %s",
                 index, try_number, resume_step, end, ", ".join(nodes), run_id, attempt_dir)
        self._watch(attempt_dir, cfg, policy, launcher, boundary=adopt.watch_boundary(cfg, cfg))
        return None

    def _adopt(self, spec: JobSpec, policy: LoadedPolicy, lineage: Any,  # noqa: ANN401
               parent: str, attempt_dir: Path, latest: Any, corrupt: list[Any],  # noqa: ANN401
               try_number: int, task_started: float, launcher: Launcher) -> bool:
        """Adopt the workload an earlier segment left running, if it may be; see
        relay.launchers.local.adopt."""
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
            **adopt.kept_interval(workload, attempt_dir, cfg.checkpoint_every),
            "segment": index, "attempt": try_number, "nodes": ",".join(cfg.nodes),
            "resume_step": resume_step, "end_step": end, "world_size": spec.world_size,
            "resume_checkpoint": str(latest.manifest.ref) if latest else "none (step 0)",
            "policy_sha256": policy.sha256, "attempt_dir": str(attempt_dir),
            "adopted_workload": str(workload),
        })
        self._corrupt(lineage, run_id, corrupt, policy,
                      self._history(attempt_dir.parent, exclude=attempt_dir))
        _ends, next_end = adopt.lookahead(spec, index)
        at = adopt.adopt(attempt_dir, workload, run_id=run_id, segment=index,
                         attempt=try_number, resume_step=resume_step, end=end,
                         next_end=next_end)
        if at is None:
            log.warning("Not adopting the workload %s: it went silent and was stopped first. "
                        "Launching afresh", workload)
            lineage.fence_attempt(run_id, "abandoned: the workload it was to adopt was stopped")
            lineage.finish_run(run_id, "abandoned")
            return False
        lineage.set_tags(run_id, {"relay.adopted_at_step": str(at)})
        resume_time.note_launch(attempt_dir, task_started, time.time())
        view = adopt.attempt_view(attempt_dir, cfg)
        self._watch(workload, cfg, policy, launcher, boundary=adopt.watch_boundary(view, cfg),
                    settled=True)
        return True  # not reached: _watch defers

    def _watch(self, attempt_dir: Path, cfg: LaunchConfig, policy: LoadedPolicy,
               launcher: Launcher, kinds: list[str] | None = None,
               boundary: int | None = None, settled: bool = False) -> None:
        """Defer to the watcher (``kinds``: the fault kinds to watch; None: all; ``boundary``:
        the step whose passing completes the segment while its workload trains on;
        ``settled``: the workload was adopted, past its start-up already)."""
        node_ranks = {n: [cfg.global_rank(n, r) for r in range(cfg.ranks_per_node)]
                      for n in cfg.nodes}
        detection = policy.policy.detection
        history = self._history(attempt_dir.parent, exclude=attempt_dir)
        # Only the trigger's own arguments survive deferral reliably (``dag.test``
        # drops defer kwargs): the launch record rides there, back to execute_complete.
        self.defer(
            trigger=SegmentWatchTrigger(
                attempt_dir=str(attempt_dir), node_ranks=node_ranks,
                detection=detection.model_dump(),
                heartbeat_interval_seconds=cfg.heartbeat_interval_seconds,
                poll_interval_seconds=detection.poll_interval, kinds=kinds,
                launcher=launcher.config(), boundary_step=boundary,
                unattended=unattended.plan(policy.policy, history, policy.sha256),
                launch_record=launch_record.build(cfg, launcher),
                spare=self._spare(cfg, launcher), settled=settled,
            ),
            method_name="execute_complete",
        )

    def _spare(self, cfg: LaunchConfig, launcher: Launcher) -> dict[str, Any] | None:
        """Return the standby the watcher warms at a sign of a fault (launchers.local.spare): on
        the first free node, in this segment's standby folder, where its retry looks.
        The launcher keeps a resident agent there (relay_train.agent.resident; the local
        launcher one per DAG run, for all its nodes), which preloads beside the ranks at
        a lower priority, so the standby is forked at once."""
        spec = self.spec()
        run_id = self._task_context["dag_run"].run_id
        taken = set(cfg.nodes)
        free = [n for n in launcher.slots(NodePool().available(_lease_holder(spec.dag_id, run_id)))
                if n not in taken]
        directory = segment_dir(spec, run_id, self.segment) / STANDBY_DIR
        launcher.reside(directory.parent.parent, free[:1])
        return spare.plan(directory, free, STANDBY_TTL_SECONDS)

    # -- decide --------------------------------------------------------------------

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
        """Stop the workload, decide per policy, record, and succeed or raise.

        However the attempt ends, its nodes' lease ends with it (not when it defers again).
        """
        watching = False
        self._task_context = context
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
        testhooks.pause("complete", attempt_dir=str(attempt_dir))
        spec = self.spec()
        # This try's own folder: the attempt folder, or where it recorded an adoption.
        record_dir = segment_dir(spec, context["dag_run"].run_id, self.segment) / (
            f"try-{int(context['ti'].try_number)}")
        if adopt.read_adopted(record_dir) is None:
            record_dir = attempt_dir
        lineage = lineage_store()
        launcher = launcher_for(spec)
        entry = journal.read(context, record_dir.parent) or {}
        cfg = adopt.attempt_view(record_dir, launch_record.find(
            attempt_dir, launcher, lineage.tracking_uri, event.get(launch_record.KEY),
            entry.get(launch_record.KEY)))
        status = event.get("status")
        if event.get("refused"):  # messages from agents of another attempt (fencing)
            log.warning("Refused %d message source(s) of other attempts while watching: %s",
                        len(event["refused"]), event["refused"])
        if status == "completed" and event.get("refused"):  # a fault records them in its
            best_effort("record the refused messages", lambda: lineage.log_json(  # decision,
                cfg.run_id, "refused.json", event["refused"]))  # after the stop (MLflow last)
        if status == "completed" and event.get("boundary_step") is not None:
            with self._freeze_guard(context, spec, self.segment + 1):
                parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id)
                return self._handed_over(event, record_dir, attempt_dir, cfg, lineage, launcher,
                                         woke, parent)
        if status == "completed":
            survivors = launcher.stop(attempt_dir)
            adopt.let_go(attempt_dir)
            self._log_observations(lineage, cfg.run_id, record_dir)
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

    def _log_observations(self, lineage: Any, run_id: str, record_dir: Path) -> None:  # noqa: ANN401
        """Log the attempt's observe-mode records (the task state store's, and this
        machine's files) to its MLflow run."""
        observed = journal.observations(self._task_context, record_dir)
        best_effort("log the observations",
                    lambda: log_observations(lineage, run_id, record_dir, observed))

    def _handed_over(self, event: dict[str, Any], record_dir: Path, workload: Path,
                     cfg: LaunchConfig, lineage: Any, launcher: Launcher,  # noqa: ANN401
                     woke: float, parent: str) -> dict[str, Any]:
        """Every rank passed this segment's end: succeed once its checkpoint is in MLflow,
        and leave the workload training for the next segment's task to adopt."""
        step = int(event["boundary_step"])
        timeout = self.policy(self.spec()).policy.detection.checkpoint_timeout
        if not adopt.wait_published(lineage, parent, cfg.run_id, step, timeout, workload):
            launcher.stop(workload)
            adopt.let_go(workload)
            lineage.finish_run(cfg.run_id, "no_checkpoint")
            raise AirflowException(
                f"Segment {self.segment}: every rank passed step {step}, but its checkpoint "
                f"was not in MLflow within {timeout:g}s (detection.checkpoint_timeout); the "
                "workload was stopped and the retry resumes from the latest checkpoint")
        self._log_observations(lineage, cfg.run_id, record_dir)
        lineage.finish_run(cfg.run_id, "completed", {"relay.handed_over_at_step": str(step)})
        self._complete_resume_time(record_dir, lineage)
        adopt.note_boundary(record_dir, event.get("at"), woke)
        self._workload_continues = True
        log.info("Segment %d trained steps [%d, %d); its checkpoint at step %d is in MLflow and "
                 "the workload %s trains on, for the next segment to adopt", self.segment,
                 cfg.start_step, cfg.end_step, step, workload)
        return {"segment": self.segment, "resumed_from": cfg.start_step,
                "trained_steps": cfg.end_step - cfg.start_step, "handed_over": str(workload)}







