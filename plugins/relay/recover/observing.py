"""The pipeline in observe mode: record and notify what Relay would do, and act on nothing.

A rule (or a whole policy) in observe mode keeps the attempt running when it
still is: the watcher goes on watching every other fault kind. An attempt whose
processes ended anyway (a crash ends the job, observed or not) is recorded as
faulted, with the decision that was not applied.
"""

from __future__ import annotations

from relay.core.attempt import AttemptState
from relay.lineage.tags import TAG_MODE
from relay.policy.decide import Decision
from relay.policy.observe import ENDS_ATTEMPT, record_observation, watched_kinds
from relay.recover import journal, record
from relay.recover.recovery import Outcome, Recovery, TaskSide


def observe(r: Recovery, t: TaskSide, decision: Decision) -> Outcome:
    """Record and notify ``decision`` without applying it; say whether to watch on."""
    message = "OBSERVE MODE (not applied): " + record.decision_line(t.segment, r.fault,
                                                                     decision, applied=False)
    folder = r.attempt.folder
    entry = record_observation(folder, r.fault, decision, t.policy, message)
    journal.note_observation(t.context, folder, entry)
    observed = journal.observations(t.context, folder)
    state = r.launcher.status(r.attempt).state
    if state is AttemptState.RUNNING and r.fault.kind not in ENDS_ATTEMPT:
        return Outcome(AttemptState.RUNNING, decision, message,
                       watch_kinds=watched_kinds(folder, observed))
    if state is AttemptState.COMPLETED:
        return Outcome(AttemptState.COMPLETED, decision, message)
    survivors = r.launcher.stop(r.attempt)
    if r.launcher.continuity is not None:
        r.launcher.continuity.let_go(r.attempt)
    record.write_decision(folder, {**entry, "survivors": survivors})
    journal.note_fault(t.context, folder, r.fault.kind)  # counted, as decision.json is
    record.record_fault(t.lineage, r.cfg.run_id, folder, entry,
                        record.fault_tags(r.fault, decision, **{TAG_MODE: "observe"}),
                        observed)
    return Outcome(AttemptState.RECORDED, decision, message, retry=False)
