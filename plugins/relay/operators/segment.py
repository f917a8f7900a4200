"""TrainSegmentOperator: launch a segment on healthy nodes (or adopt the workload the
previous segment handed over), defer to the watcher, and finish, hand over, or recover.

Nothing survives deferral, so ``execute_complete`` finds the workload again
from the event: the launch record (config and launcher handle) travels in the
watcher's arguments and comes back in its event, or from the task state store
(:mod:`relay.launchers.launch_record`), never only from the folder ``execute`` wrote.
A fault goes to the recovery pipeline (:func:`relay.recover.pipeline.handle`);
its outcome becomes Airflow's retry (:class:`~relay.operators.retry.SegmentFaultError`)
or a failure for good. The local launcher's handovers and warm starts are asked
for through ``launcher.continuity`` (:mod:`relay.operators.handover`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from relay.core import testhooks
from relay.core.attempt import Attempt, AttemptState
from relay.core.checkpoint_keys import checkpoint_keys
from relay.core.exceptions import ChaosConfError, IllegalTransitionError, NotEnoughNodesError
from relay.core.faults import Fault
from relay.launchers import Launcher, launch_record, launcher_for
from relay.lineage import resume_time
from relay.lineage.interval import interval_for
from relay.lineage.tags import TAG_FAILURE_REASON
from relay.nodes.pool import NodePool, lease_holder
from relay.operators import handover
from relay.operators.airflow_notes import write_notes
from relay.operators.base import RelayOperator, attempt_params, lineage_store, segment_dir
from relay.operators.retry import SegmentFaultError
from relay.operators.segment_end import SegmentEnd
from relay.policy.model import LoadedPolicy
from relay.policy.notify import escalate
from relay.recover import journal
from relay.recover.corrupt import record_corrupt
from relay.recover.pipeline import handle
from relay.recover.record import best_effort
from relay.recover.recovery import Outcome, Recovery, TaskSide
from relay.recover.warden import plan
from relay.spec.chaos_conf import chaos_faults
from relay.spec.job import JobSpec
from relay.watch.triggers import SegmentWatchTrigger
from relay_train.protocol.launch import LaunchConfig
from relay_train.protocol.run_lease import RUN_LEASE_SECONDS

log = logging.getLogger(__name__)


class TrainSegmentOperator(SegmentEnd, RelayOperator):
    """Train steps ``[latest checkpoint, segment end)`` on healthy nodes, watched by a trigger."""

    def __init__(self, *, segment: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.segment = segment

    # -- launch ------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any] | None:  # noqa: ANN401
        """Launch the segment (or adopt the running workload) and defer to the watcher,
        or do nothing if already past it."""
        task_started = time.time()
        spec = self.spec()
        with self._guard(context, spec, self.segment):
            return self._execute(context, spec, task_started)

    def _guard(self, context: Any, spec: JobSpec,  # noqa: ANN401
               index: int) -> contextlib.AbstractContextManager[None]:
        """Guard MLflow calls made while an earlier segment's workload runs unwatched."""
        continuity = launcher_for(spec).continuity
        if continuity is None:
            return contextlib.nullcontext()
        run_dir = segment_dir(spec, context["dag_run"].run_id, self.segment).parent
        silent = self.policy(spec).policy.detection.heartbeat_timeout
        return continuity.guard(run_dir, index, silent)

    def _execute(self, context: Any, spec: JobSpec,  # noqa: ANN401
                 task_started: float) -> dict[str, Any] | None:
        policy = self.policy(spec)
        index, start, end = spec.segments[self.segment]
        dag_run = context["dag_run"]
        try_number = int(context["ti"].try_number)
        chaos = self._chaos(dag_run, spec)
        lineage = lineage_store()
        parent = lineage.parent_run(spec.job, spec.dag_id, dag_run.run_id)
        seg_dir = segment_dir(spec, dag_run.run_id, index)
        launcher = launcher_for(spec)
        self._finish_interrupted(context, seg_dir, lineage, launcher)
        self._stop_leftovers(context, seg_dir, launcher, lineage, parent, index)
        folder = _fresh_folder(seg_dir / f"try-{try_number}")
        keys = checkpoint_keys()  # Airflow's Variable or Connection, a key file, or the default
        latest, corrupt = lineage.resume_point(parent, folder / "resume", keys)
        resume_step = latest.manifest.step if latest else 0
        continuity = launcher.continuity
        hands_over = continuity is not None and continuity.hands_over(spec)
        if hands_over and handover.adopt(self, context, spec, policy, lineage, parent, folder,
                                         latest, corrupt, task_started, launcher):
            return None
        if resume_step >= end:
            log.info("Segment %d [%d, %d) already done: latest checkpoint is at step %d (%s); "
                     "no-op", index, start, end, resume_step,
                     latest.manifest.ref if latest else "-")
            if hands_over and index == len(spec.segments) - 1:  # it ends by itself
                continuity.wait_for_end(seg_dir.parent, index)
            return {"segment": index, "resumed_from": resume_step, "trained_steps": 0}
        if resume_step != start:
            log.warning("Segment %d starts at step %d; resuming from the latest valid checkpoint "
                        "at step %d", index, start, resume_step)
        avoid = journal.avoided_node(context, seg_dir)
        nodes = launcher.slots(self._nodes(spec, policy, lease_holder(spec.dag_id,
                                                                      dag_run.run_id), avoid))
        interval = interval_for(spec, lineage)  # checkpoint_every: auto reads the job's record
        run_id = lineage.attempt_run(parent, index, try_number, {
            **interval.params(), **attempt_params(spec, policy, index, try_number, nodes,
                                                  resume_step, latest, folder)})
        interval.record(folder)
        self._corrupt(context, lineage, run_id, corrupt, policy, folder)
        boundaries, run_on_to = continuity.run_on(spec, index) if hands_over else ([], None)
        cfg = LaunchConfig(
            job=spec.job, seed=spec.seed, model=spec.model.model_dump(),
            data=spec.data.model_dump(), optimizer=spec.optimizer.model_dump(),
            start_step=resume_step, end_step=end, checkpoint_every=interval.steps,
            nodes=nodes, ranks_per_node=spec.ranks_per_node,
            tracking_uri=lineage.tracking_uri, run_id=run_id,
            attempt_dir=str(folder), attempt=try_number, segment=index,
            heartbeat_interval_seconds=spec.heartbeat_interval,
            collective_timeout_seconds=spec.collective_timeout,
            resume=latest.resume_from() if latest is not None else None, chaos=chaos,
            entrypoint=spec.launch_entrypoint(Path(self.spec_file)), backend=spec.backend,
            deterministic=spec.deterministic, boundaries=boundaries, run_on_to=run_on_to,
            checkpoint_keys=keys.to_dict(), total_steps=spec.total_steps,
            steps_per_epoch=spec.steps_per_epoch or 0,
        )
        launch_called = time.time()
        if continuity is not None:  # what it keeps warm for this run leaves without renewals
            continuity.keep_run(seg_dir.parent, RUN_LEASE_SECONDS)
        attempt = launcher.launch(cfg)
        journal.write(context, seg_dir, AttemptState.RUNNING, attempt_dir=str(folder),
                      run_id=run_id, nodes=nodes,
                      **{launch_record.KEY: launch_record.build(cfg, launcher)})
        resume_time.note_launch(folder, task_started, launch_called)
        log.info("Segment %d try %d: steps [%d, %d) on %s; MLflow child run %s; attempt folder %s",
                 index, try_number, resume_step, end, ", ".join(nodes), run_id, folder)
        if try_number > 1:  # "restarted on these nodes": the notes of the fault before
            write_notes(context, lineage, lambda: parent, index)
        self._watch(context, attempt, cfg, policy, launcher,
                    boundary=handover.boundary(launcher, cfg, cfg))
        return None

    def _chaos(self, dag_run: Any, spec: JobSpec) -> list[dict[str, Any]]:  # noqa: ANN401
        try:
            return chaos_faults(dag_run.conf, spec, Path(self.spec_file))
        except ChaosConfError as exc:
            raise AirflowFailException(str(exc)) from exc

    def _nodes(self, spec: JobSpec, policy: LoadedPolicy, holder: str,
               avoid: str | None = None) -> list[str]:
        rules = policy.policy.nodes
        wait = rules.wait_up_to if rules.when_too_few == "wait" else 0.0
        if avoid is not None:
            log.info("Leaving %s out of this try: the last one was preempted there", avoid)
        try:
            return NodePool().select(spec.nodes, wait_up_to=wait, holder=holder,
                                     leave_out=frozenset({avoid} if avoid else ()))
        except NotEnoughNodesError as exc:
            message = f"Segment {self.segment} of {spec.dag_id}: {exc}"
            escalate(policy.policy.escalation.target, message, policy.policy.escalation,
                     {"reason": "not_enough_nodes", "policy_sha256": policy.sha256})
            raise AirflowFailException(message) from exc

    def _finish_interrupted(self, context: Any, seg_dir: Path, lineage: Any,  # noqa: ANN401
                            launcher: Launcher) -> None:
        """Finish the record of a fault a killed try was handling; fail this try if its
        policy gave up (this try is the retry it decided on, otherwise)."""
        outcome = journal.finish_interrupted(
            context, seg_dir, lambda attempt, fault, cfg: self._recover(
                context, fault, attempt, handover.view(launcher, attempt, cfg), lineage,
                launcher),
            launcher, lineage.tracking_uri)
        if outcome is not None and outcome.state is AttemptState.RECORDED and not outcome.retry:
            raise AirflowFailException(outcome.message)

    @staticmethod
    def _stop_leftovers(context: Any, seg_dir: Path, launcher: Launcher,  # noqa: ANN401
                        lineage: Any, parent: str, index: int) -> None:  # noqa: ANN401
        """Stop what a task killed mid-segment left running, and close the MLflow runs of
        such launches as abandoned."""
        journal.stop_launched(context, seg_dir, launcher, lineage.tracking_uri)
        launcher.stop_all(seg_dir)
        if launcher.continuity is not None:
            launcher.continuity.stop_adopted(seg_dir)
        lineage.abandon_running(parent, index)

    def _corrupt(self, context: Any, lineage: Any, run_id: str,  # noqa: ANN401
                 corrupt: list[Any], policy: LoadedPolicy, folder: Path) -> None:  # noqa: ANN401
        """Record corrupt checkpoints met on the way to the resume point; obey their rule."""
        history = journal.fault_history(context, folder.parent, exclude=folder)
        failed = record_corrupt(lineage, run_id, corrupt, policy, history, self.segment)
        if failed is not None:
            raise AirflowFailException(failed)

    def _watch(self, context: Any, attempt: Attempt, cfg: LaunchConfig,  # noqa: ANN401
               policy: LoadedPolicy, launcher: Launcher, kinds: list[str] | None = None,
               boundary: int | None = None, settled: bool = False) -> None:
        """Defer to the watcher (``kinds``: the fault kinds to watch; None: all; ``boundary``:
        the step whose passing completes the segment while its workload trains on;
        ``settled``: the workload was adopted, past its start-up already)."""
        node_ranks = {n: [cfg.global_rank(n, r) for r in range(cfg.ranks_per_node)]
                      for n in cfg.nodes}
        detection = policy.policy.detection
        history = journal.fault_history(context, attempt.segment_dir, exclude=attempt.folder)
        # Only the trigger's own arguments survive deferral reliably (``dag.test``
        # drops defer kwargs): the launch record rides there, back to execute_complete.
        self.defer(
            trigger=SegmentWatchTrigger(
                attempt_dir=str(attempt.runs_in), node_ranks=node_ranks,
                detection=detection.model_dump(),
                heartbeat_interval_seconds=cfg.heartbeat_interval_seconds,
                poll_interval_seconds=detection.poll_interval, kinds=kinds,
                launcher=launcher.config(), boundary_step=boundary,
                unattended=plan(policy.policy, history, policy.sha256),
                launch_record=launch_record.build(cfg, launcher),
                spare=self._spare(context, attempt, cfg, launcher), settled=settled,
            ),
            method_name="execute_complete",
        )

    def _spare(self, context: Any, attempt: Attempt, cfg: LaunchConfig,  # noqa: ANN401
               launcher: Launcher) -> dict[str, Any] | None:
        """Return the standby the watcher warms at a sign of a fault: on the first free node,
        where the retry looks (None: the launcher has no warm starts)."""
        if launcher.continuity is None:
            return None
        holder = lease_holder(self.spec().dag_id, context["dag_run"].run_id)
        free = [n for n in launcher.slots(NodePool().available(holder)) if n not in cfg.nodes]
        return launcher.continuity.plan_spare(Attempt(attempt.folder), free)

    # -- the watcher's event -------------------------------------------------------

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
                NodePool().release_lease(lease_holder(self.spec().dag_id,
                                                      context["dag_run"].run_id))

    def _complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
        woke = time.time()  # the deferred task runs again (time to resume: wake)
        workload = Path(event["attempt_dir"])  # where the workload runs
        testhooks.pause("complete", attempt_dir=str(workload))
        spec = self.spec()
        lineage = lineage_store()
        launcher = launcher_for(spec)
        attempt = handover.attempt_of(launcher, segment_dir(
            spec, context["dag_run"].run_id, self.segment) / f"try-{context['ti'].try_number}",
            workload)
        entry = journal.read(context, attempt.segment_dir) or {}
        cfg = handover.view(launcher, attempt, launch_record.find(
            workload, launcher, lineage.tracking_uri, event.get(launch_record.KEY),
            entry.get(launch_record.KEY)))
        status = _watched(event)
        if event.get("refused"):  # messages from agents of another attempt (fencing)
            log.warning("Refused %d message source(s) of other attempts while watching: %s",
                        len(event["refused"]), event["refused"])
        if status is AttemptState.FAULTED:
            return self._recover(context, Fault.from_event(event["fault"]), attempt, cfg,
                                 lineage, launcher, woke, event.get("refused"), act=True)
        if status is AttemptState.COMPLETED and event.get("refused"):  # a fault records them
            best_effort("record the refused messages", lambda: lineage.log_json(  # in its
                cfg.run_id, "refused.json", event["refused"]))  # decision
        if status is AttemptState.COMPLETED and event.get("boundary_step") is not None:
            with self._guard(context, spec, self.segment + 1):
                parent = lineage.parent_run(spec.job, spec.dag_id, context["dag_run"].run_id)
                self._workload_continues = handover.handed_over(
                    self, context, event, attempt, cfg, lineage, launcher, woke, parent)
                return self._result(cfg, handed_over=str(workload))
        survivors = launcher.stop(attempt)
        if launcher.continuity is not None:
            launcher.continuity.let_go(attempt)
        if status is AttemptState.FAILED:
            lineage.finish_run(cfg.run_id, AttemptState.FAILED, {
                TAG_FAILURE_REASON: f"watcher error: {event.get('message')}"[:4000]})
            raise AirflowException(f"Segment {self.segment}: watcher error "
                                   f"{event.get('message')}\n{event.get('traceback', '')}")
        self.log_observations(context, lineage, cfg.run_id, attempt)
        if survivors:
            lineage.finish_run(cfg.run_id, AttemptState.FAILED, {
                TAG_FAILURE_REASON: f"processes {survivors} survived their stop"})
            raise AirflowException(f"Segment {self.segment}: processes {survivors} survived")
        lineage.finish_run(cfg.run_id, AttemptState.COMPLETED)
        if launcher.continuity is not None:
            launcher.continuity.note_boundary(attempt, event.get("at"), woke)
        self.resumed(context, attempt, lineage, launcher, lambda: lineage.parent_run(
            spec.job, spec.dag_id, context["dag_run"].run_id))
        log.info("Segment %d trained steps [%d, %d) in %.1fs", self.segment, cfg.start_step,
                 cfg.end_step, time.time() - launcher.started_at(attempt))
        return self._result(cfg)

    def _result(self, cfg: LaunchConfig, **extra: Any) -> dict[str, Any]:  # noqa: ANN401
        return {"segment": self.segment, "resumed_from": cfg.start_step,
                "trained_steps": cfg.end_step - cfg.start_step, **extra}

    def _recover(self, context: Any, fault: Fault, attempt: Attempt,  # noqa: ANN401
                 cfg: LaunchConfig, lineage: Any, launcher: Launcher,  # noqa: ANN401
                 woke: float | None = None, refused: list[dict[str, Any]] | None = None,
                 act: bool = False) -> Outcome | dict[str, Any]:
        """Run the recovery pipeline on a fault; with ``act``, act on its outcome (watch on,
        complete, raise for Airflow's retry, or fail for good), else return the outcome."""
        spec = self.spec()
        policy = self.policy(spec)
        if launcher.continuity is not None:
            launcher.continuity.copy_strikes(attempt)
        run_id = context["dag_run"].run_id
        outcome = handle(Recovery(attempt, fault, cfg, launcher, policy.policy.detection,
                                  task=TaskSide(
            context=context, policy=policy, lineage=lineage,
            parent_run=lambda: lineage.parent_run(spec.job, spec.dag_id, run_id),
            segment=self.segment, holder=lease_holder(spec.dag_id, run_id),
            nodes_needed=spec.nodes, woke=time.time() if woke is None else woke,
            refused=list(refused or []))))
        if outcome.state is AttemptState.RECORDED and not outcome.decision.observe:
            self.finish_resume_time(attempt, lineage, launcher)  # off the critical path
            write_notes(context, lineage, lambda: lineage.parent_run(spec.job, spec.dag_id,
                                                                     run_id), self.segment)
        if not act:
            return outcome
        if outcome.state is AttemptState.RUNNING:  # observe mode: watch the other kinds
            workload = launch_record.config_of(attempt.runs_in)
            self._watch(context, attempt, workload, policy, launcher, kinds=outcome.watch_kinds,
                        boundary=handover.boundary(launcher, cfg, workload))
        if outcome.state is AttemptState.COMPLETED:
            return self._complete(context, {"status": AttemptState.COMPLETED.value,
                                            "attempt_dir": str(attempt.runs_in)})
        if outcome.retry:
            raise SegmentFaultError(outcome.message, outcome.decision)
        raise AirflowFailException(outcome.message)


def _watched(event: dict[str, Any]) -> AttemptState:
    """Return the state the watcher saw the attempt reach (FAILED for one it cannot name)."""
    try:
        return AttemptState.RUNNING.to(AttemptState(event.get("status")))
    except (ValueError, IllegalTransitionError):
        log.error("The watcher reported %r, not a state a running attempt can reach",
                  event.get("status"))
        return AttemptState.FAILED


def _fresh_folder(folder: Path) -> Path:
    """Return the try's folder, setting aside an earlier run of the same try number
    (`airflow tasks test`, or a task killed before Airflow counted a new try): its
    evidence is kept, its heartbeats never mixed in."""
    if folder.exists():
        aside = folder.with_name(f"{folder.name}.stale-{int(time.time())}")
        folder.rename(aside)
        log.warning("Moved the earlier run of %s to %s", folder, aside)
    return folder
