"""The recovery pipeline: one fault of one attempt, from the decision to its record.

    decide -> claim -> save state -> stop -> (confirm the culprit) -> fence -> quarantine
    -> record

:func:`handle` runs it. The segment task's ``execute_complete`` runs it all the
way, with the policy's decision; the attempt's warden (:mod:`relay.recover.warden`),
when no one took the fault within ``stop_unattended_after``, runs it up to the
stop, with the step the policy named when the watch began, and leaves the rest to
the task, which finds what the warden saved at its claim. Nothing here imports
Airflow: the caller turns the :class:`Outcome` into Airflow's retry or failure.

A hang's culprit is the watcher's reading of the heartbeat phases; after the stacks
are in, it is confirmed against them (:mod:`relay.recover.culprit`) and, where they
name another rank or none, decided again: only the quarantine and the reason change.

The order matters. The pipeline decides, saves and stops before touching MLflow:
a frozen rank may hold the tracking store's lock until its process is gone. It
fences after the stop: whatever the attempt's nodes publish from then on (one the
stop could not reach, coming back) is refused by the resume chooser.

How the next try's nodes are chosen: the decision may quarantine the culprit's
machine (:class:`relay.nodes.pool.NodePool`, enforced by the launcher). The retry
asks the node pool for healthy nodes: not quarantined, not leased to another DAG
run, this run's lease first (:meth:`NodePool.select`). Meanwhile, while this
attempt is stopped, a launcher with :class:`~relay.launchers.base.Continuity`
warms agents on the nodes that lease will pick (quarantined ones left out).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from relay.core import testhooks
from relay.core.attempt import AttemptState
from relay.core.faults import CULPRIT_CHECK, Fault
from relay.launchers import Launcher, launch_record
from relay.lineage import resume_time
from relay.nodes.pool import NodePool
from relay.policy.decide import Decision, decide
from relay.policy.model import STOP_GRACE_SECONDS
from relay.policy.notify import escalate
from relay.recover import claim, journal, observing, record
from relay.recover.ask_rescue import silent
from relay.recover.culprit import confirm_culprit
from relay.recover.recovery import Outcome, Recovery, TaskSide
from relay.recover.resume import next_resume
from relay.recover.save_state import (
    STOP,
    Saved,
    as_record,
    from_warden,
    save_state,
    save_step,
)
from relay.recover.warden_record import Stopped, fetch
from relay_train.protocol.routes import STANDBY_TTL_SECONDS
from relay_train.protocol.run_lease import RUN_LEASE_SECONDS

log = logging.getLogger(__name__)


def handle(r: Recovery) -> Outcome:
    """Run the pipeline for ``r``: all of it for the task, up to the stop for the warden."""
    t = r.task
    clock = resume_time.ResumeClock(resume_time.fault_onset(r.attempt.folder),
                                    r.fault.detected_at, time.time() if t is None else t.woke)
    decision = None if t is None else _decide(r, t)                       # decide
    if t is not None and decision is not None and decision.observe:
        return observing.observe(r, t, decision)
    r.launcher.channel(r.attempt).mark_silent(silent(r.fault, r.cfg)[0])
    if t is not None and decision is not None:
        _begin(r, t, decision)
    clock.mark("decide", time.time())
    progress = _progress(r)
    step = save_step(decision, r.fault.kind) if decision is not None else r.step or STOP
    with claim.take(r.attempt, r.role, r.launcher,                          # claim
                    wait_seconds=r.detection.checkpoint_timeout + 30,
                    fetch=_fetch(r), warden_due=_warden_due(r)) as taken:
        if not taken.ours:
            return Outcome(AttemptState.FAULTED, message="claimed by another actor")
        if t is None:
            log.warning("No one handled the %s fault of %s within %.0fs of its detection (is "
                        "Airflow's scheduler down?); stopping the workload (%s first)",
                        r.fault.kind.value, r.attempt, r.detection.stop_unattended_after, step)
        saved = _save(r, taken, decision, step)                             # save state
        clock.mark("rescue", time.time())
        survivors = _stop(r)                                                # stop
        clock.mark("stop", time.time())
        if t is None:
            _keep_warden_record(r, step, saved, survivors)
    if t is None or decision is None:
        _publish_warden_record(r)
        return Outcome(AttemptState.HANDLING, message="stopped")
    r, decision = _confirm(r, t, decision, saved)                          # (culprit)
    fence = f"replaced after {r.fault.kind.value} (try {r.cfg.attempt})"
    record.best_effort("fence the attempt",                                # fence
                       lambda: t.lineage.fence_attempt(r.cfg.run_id, fence))
    testhooks.pause("record", attempt_dir=str(r.attempt.runs_in))
    quarantine(decision, r.fault, t.holder, r.launcher)                     # quarantine
    return _record(r, t, decision, saved, survivors, progress, fence, clock)  # record


def _decide(r: Recovery, t: TaskSide) -> Decision:
    """Return the policy's decision; a quarantine names the machine, not the node's slot."""
    history = journal.fault_history(t.context, r.attempt.segment_dir, exclude=r.attempt.folder)
    decision = decide(r.fault, history, t.policy.policy, t.policy.sha256)
    if decision.quarantine_node:
        host = r.launcher.host_of(r.attempt, decision.quarantine_node)
        decision = dataclasses.replace(decision, quarantine_node=host)
    if decision.avoid_node:
        host = r.launcher.host_of(r.attempt, decision.avoid_node)
        decision = dataclasses.replace(decision, avoid_node=host)
    return decision


def _confirm(r: Recovery, t: TaskSide, decision: Decision,
             saved: Saved) -> tuple[Recovery, Decision]:
    """Confirm a hang's culprit against the ranks' stacks and collective trace (the phases
    miss collectives outside the gradient hook); decide again on the confirmed fault."""
    cfg = r.cfg
    fault = confirm_culprit(r.fault, saved.evidence, list(range(cfg.world_size)),
                            lambda rank: cfg.nodes[rank // cfg.ranks_per_node])
    if fault is r.fault:
        return r, decision
    note = fault.evidence[CULPRIT_CHECK]["note"]
    if fault.culprit_rank != r.fault.culprit_rank:
        log.warning("Culprit of the %s fault: %s", fault.kind.value, note)
    else:
        log.info("Culprit of the %s fault: %s", fault.kind.value, note)
    r = dataclasses.replace(r, fault=fault)
    return r, _decide(r, t)


def _begin(r: Recovery, t: TaskSide, decision: Decision) -> None:
    """Journal the handling (a killed task's retry finishes it), and have the retry's
    agents preload while this attempt winds down."""
    journal.write(t.context, r.attempt.segment_dir, AttemptState.HANDLING,
                  attempt_dir=str(r.attempt.runs_in), record_dir=str(r.attempt.folder),
                  fault=r.fault.to_event()["fault"],
                  **{launch_record.KEY: launch_record.build(
                      launch_record.config_of(r.attempt.runs_in, r.cfg), r.launcher)})
    continuity = r.launcher.continuity
    if decision.retry and continuity is not None:
        # Hold the run through the backoff: no watcher renews its lease meanwhile.
        continuity.keep_run(r.attempt.run_dir, decision.backoff_seconds + RUN_LEASE_SECONDS)
        out = {n for n in (decision.quarantine_node, decision.avoid_node) if n}
        nodes = NodePool().next_lease(t.holder, t.nodes_needed, out)
        if nodes:  # else the retry waits for nodes: nothing to warm up
            # They wait out the backoff too, and leave by themselves if no retry comes.
            continuity.warm_for_retry(r.attempt, r.launcher.slots(nodes),
                                      decision.backoff_seconds + STANDBY_TTL_SECONDS)


def _progress(r: Recovery) -> int:
    """Return the furthest step a rank reported (over the channel, not from files)."""
    if r.task is None:
        return r.cfg.start_step
    beats = r.launcher.status(r.attempt).heartbeats
    return max((b.step for b in beats.values()), default=r.cfg.start_step)


def _fetch(r: Recovery) -> Callable[[], Stopped | None] | None:
    """Return how the task brings what a warden on another machine saved (from MLflow)."""
    if r.task is None:
        return None
    lineage, run_id, where = r.task.lineage, r.cfg.run_id, r.attempt.runs_in
    return lambda: fetch(lineage, run_id, where)


def _warden_due(r: Recovery) -> float | None:
    """Return when the attempt's warden would claim it (None: there is none)."""
    after = r.detection.stop_unattended_after
    return None if r.task is None or after is None else r.fault.detected_at + after


def _save(r: Recovery, taken: claim.Taken, decision: Decision | None, step: str) -> Saved:
    """Save state as ``step`` says, or take what a warden already saved."""
    if taken.by_warden is not None and decision is not None:
        return from_warden(taken.by_warden, decision, r.fault, r.attempt.runs_in)
    if not taken.can_save:
        log.warning("No agent of %s answers: nothing to save from; stopping it", r.attempt)
        return Saved()
    timeouts = {"checkpoint_timeout": r.detection.checkpoint_timeout,
                "evidence_timeout": r.detection.evidence_timeout}
    return save_state(r.attempt, r.cfg, r.fault, step, timeouts, r.launcher)


def _stop(r: Recovery) -> list[str]:
    """Stop every process of the attempt; never adopt its workload again."""
    testhooks.pause("stop", attempt_dir=str(r.attempt.runs_in))
    survivors = r.launcher.stop(r.attempt, STOP_GRACE_SECONDS)
    if r.launcher.continuity is not None:
        r.launcher.continuity.let_go(r.attempt)
    return survivors


def _keep_warden_record(r: Recovery, step: str, saved: Saved, survivors: list[str]) -> None:
    """Write what the warden did into the attempt folder (under the lease)."""
    stopped = Stopped(by=f"warden pid {os.getpid()}", detected_at=float(r.fault.detected_at),
                      stopped_at=time.time(), step=step, survivors=survivors,
                      **as_record(saved))
    stopped.write(r.attempt.runs_in)
    log.warning("Stopped %s %.1fs after the fault was detected (rescued: %s, drained at: %s, "
                "survivors: %s); execute_complete decides and records when it runs",
                r.attempt, stopped.stopped_at - stopped.detected_at,
                stopped.rescued and stopped.rescued.get("step"), stopped.drained_at,
                stopped.survivors or "none")


def _publish_warden_record(r: Recovery) -> None:
    """Put the warden's record where a task on another machine reads it (MLflow, now that
    the workload is stopped: no frozen rank holds the tracking store's lock)."""
    from relay.lineage.store import Lineage
    from relay.recover.warden_record import publish

    stopped = Stopped.read(r.attempt.runs_in)
    if stopped is None:
        return
    try:
        publish(Lineage.from_settings(), r.cfg.run_id, r.attempt.runs_in, stopped)
    except Exception:  # noqa: BLE001 - the record stays here; execute_complete may be too
        log.exception("Could not log what the warden saved to MLflow run %s", r.cfg.run_id)


def quarantine(decision: Decision, fault: Fault, where: str,
               launcher: Launcher | None = None) -> None:
    """Keep the culprit's machine out, if the decision says so, and have the launcher
    enforce it."""
    if not (decision.quarantine_node and decision.quarantine_seconds):
        return
    pool = NodePool()
    try:
        pool.quarantine(
            decision.quarantine_node, decision.quarantine_seconds,
            reason=f"{fault.kind.value}: {fault.evidence.get('summary', '')}",
            by=f"{decision.rule} (policy {decision.policy_sha256[:12]}) in {where}",
        )
    except ValueError as exc:  # a host the pool does not list: record it, keep deciding
        log.error("Quarantine of %s not recorded: %s. Add it to RELAY_NODES.",
                  decision.quarantine_node, exc)
        return
    if launcher is not None:
        launcher.enforce_quarantines(pool.quarantines())


def _record(r: Recovery, t: TaskSide, decision: Decision, saved: Saved, survivors: list[str],
            progress: int, fence: str, clock: resume_time.ResumeClock) -> Outcome:
    """Find where the retry resumes, notify, and record the decision (on disk, then MLflow)."""
    resumed, rescue_record = next_resume(t.lineage, t.parent_run, decision, r.fault, r.cfg,
                                         saved, fence)
    lost = None if resumed is None else max(progress - resumed, 0)
    line = record.decision_line(t.segment, r.fault, decision, step=progress, resumed=resumed,
                                lost=lost)
    entry = {"fault": r.fault.to_event()["fault"], "decision": decision.to_dict(),
             "progress_step": progress, "next_resume_step": resumed, "lost_steps": lost,
             "drained_at_step": saved.drained_at, "drain_note": saved.note,
             "rescued": rescue_record,
             "survivors": survivors, "notification": None,
             "refused": t.refused + r.launcher.channel(r.attempt).refused,
             "time_to_resume": clock.to_dict(), "policy_file": str(t.policy.path),
             "decision_line": line}
    if decision.notify:
        details = record.decision_details(entry["fault"], decision, r.attempt.folder,
                                          r.attempt.runs_in / "logs")
        entry["notification"] = escalate(decision.notify, f"{line}\n{details}",
                                         t.policy.policy.escalation,
                                         {"decision": decision.to_dict()}).to_dict()
    journal.note_fault(t.context, r.attempt.folder, r.fault.kind)  # before MLflow: may hang
    record.record_decision(entry, r.attempt.folder, r.cfg, t.lineage, r.fault, decision,
                           saved.evidence, clock, journal.observations(t.context,
                                                                       r.attempt.folder))
    journal.write(t.context, r.attempt.segment_dir, AttemptState.RECORDED,
                  attempt_dir=str(r.attempt.runs_in), record_dir=str(r.attempt.folder),
                  **{journal.AVOID_NODE: decision.avoid_node} if decision.avoid_node else {})
    # The one line per fault, then its details (the evidence is summarised by now).
    log.error("%s", line)
    log.info("Details of the decision above:\n%s", record.decision_details(
        entry["fault"], decision, r.attempt.folder, r.attempt.runs_in / "logs"))
    return Outcome(AttemptState.RECORDED, decision, line, retry=decision.retry)
