"""`relay policy explain`: what a policy will do, in plain sentences, for its owners."""

from __future__ import annotations

from relay.core.faults import RESCUABLE, FaultKind
from relay.core.urls import redact
from relay.policy.decide import ordinal, rule_mode
from relay.policy.model import (
    MIN_SLOW_STEPS,
    UNATTENDED_MARGIN_SECONDS,
    Detection,
    LoadedPolicy,
)
from relay.policy.rules import HEALTHY_NODE, JOB_WIDE, Action, Escalation, Mode, Rule
from relay.spec.job import JobSpec

_UNITS = ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second"))


def humanize(seconds: float) -> str:
    """Return 1800 as '30 minutes', 1.5 as '1.5 seconds', 0.5 as '500 ms'."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    for size, unit in _UNITS:
        if seconds >= size and (seconds % size == 0 or size == 1):
            value = seconds / size
            text = f"{value:g}"
            return f"{text} {unit}{'' if value == 1 else 's'}"
    return f"{seconds:g} seconds"


def fault_sentence(kind: FaultKind, d: Detection) -> str:
    """Return what the fault is and how the watcher recognises it."""
    throughput = d.throughput
    return {
        FaultKind.HANG: "a rank stalls (hang): it stays in its compute step for more than "
        f"{_hang_threshold(d)} while the other ranks wait for it",
        FaultKind.RANK_UNRESPONSIVE: "a rank stops answering (rank_unresponsive): no heartbeat "
        f"for {humanize(d.heartbeat_timeout)} while its node still answers",
        FaultKind.NODE_UNRESPONSIVE: "a node stops answering (node_unresponsive): every rank on "
        f"it and its agent are silent for {humanize(d.heartbeat_timeout)} or more",
        FaultKind.STRAGGLER: _straggler_sentence(d),
        FaultKind.THROUGHPUT_DEGRADED: (
            "the whole job slows down (throughput_degraded): samples per second stay below "
            f"{throughput.floor:.0%} of the job's own baseline for "
            f"{humanize(throughput.sustained)}"
            if throughput else "the whole job slows down (throughput_degraded): not watched by "
            "this policy"
        ),
        FaultKind.CRASH: "a rank exits with an error (crash)",
        FaultKind.LAUNCH_FAILURE: "a rank fails to start (launch_failure): no heartbeat within "
        f"{humanize(d.startup_timeout)} of the launch, or it dies before its first step (one "
        "that died because another process held its rendezvous port blames no node)",
        FaultKind.NAN_LOSS: "the loss becomes NaN or infinite (nan_loss)"
        + ("" if d.nan_loss else ": not watched by this policy"),
        FaultKind.CORRUPT_CHECKPOINT: "a checkpoint does not match the sha256 recorded when it "
        "was saved (corrupt_checkpoint)",
        FaultKind.SHORT_SEGMENT: "a rank's script returns before its segment's end "
        "(short_segment): it exits cleanly at an earlier step than the segment's last",
        FaultKind.PREEMPTED: "the platform takes a node back (preempted): its agent gets a "
        "preemption notice, a SIGTERM with a grace period (a Kubernetes eviction, Slurm's "
        "--signal, a spot reclaim); the node is healthy",
    }[kind]


def _straggler_sentence(d: Detection) -> str:
    """Return how a straggler is recognised: by the time it costs, at the latest when sustained."""
    rule = d.straggler
    if rule is None:
        return "one rank is slow (straggler): not watched by this policy"
    over = (f"one rank is slow (straggler): its compute time per step stays above "
            f"{rule.ratio:g}x the other ranks'")
    settle = (f", once the ranks have been stepping for {humanize(rule.sustained)} (start-up "
              "is uneven)")
    if rule.lost_seconds is None:
        return f"{over} for {humanize(rule.sustained)}{settle}"
    return (f"{over} for as long as it takes the job to lose {humanize(rule.lost_seconds)} "
            "waiting for it (every rank waits for it at each step, so the slower the rank, the "
            f"sooner; at least {MIN_SLOW_STEPS} slow steps in a row), or for "
            f"{humanize(rule.sustained)} at most{settle}")


def _hang_threshold(d: Detection) -> str:
    """Return the hang threshold in words: as written, or how it is derived."""
    derive = d.derive_hang_timeout
    if derive is None:
        return humanize(d.hang_timeout)
    return (f"a threshold DERIVED from the job's own steps - one heartbeat interval plus "
            f"{derive.safety_factor:g} x the job's 95th-percentile step time (checkpoint pauses "
            f"left out), at least {humanize(derive.min)} "
            f"and at most {humanize(d.hang_timeout)} ({humanize(d.hang_timeout)} until "
            f"{derive.warmup_steps} steps are seen, and when every rank is stuck at once) -")


def _action_sentence(kind: FaultKind, rule: Rule) -> str:
    action = rule.action
    source = "its latest valid checkpoint"
    if kind in RESCUABLE:
        source = ("the weights a healthy rank still holds in memory, so no steps are lost (or, "
                  "if no rank hands them over, from its latest valid checkpoint)")
    if action is Action.RETRY:
        text = f"Relay runs the segment again, on the same nodes, from {source}"
    elif action is Action.RESTART_ELSEWHERE:
        text = f"Relay stops the segment and runs it again on healthy nodes from {source}"
    elif action is Action.CHECKPOINT_AND_MIGRATE:
        text = ("Relay first has the ranks save a checkpoint, so no steps are lost, then runs the "
                "segment again on healthy nodes")
    elif action is Action.ROLLBACK:
        text = ("Relay discards the newest checkpoint and runs the segment again from the one "
                "before it")
    elif action is Action.ESCALATE:
        return "Relay stops the segment for good and notifies {target}."
    else:
        return "Relay stops the segment for good, without retrying and without notifying anyone."
    if rule.quarantine is not None and kind not in JOB_WIDE:
        text += (f"; the culprit's node is kept out of every job for "
                 f"{humanize(rule.quarantine)}")
    if kind in HEALTHY_NODE and action in (Action.RESTART_ELSEWHERE,
                                           Action.CHECKPOINT_AND_MIGRATE):
        text += (" without the preempted node, for that attempt only (it is not quarantined); "
                 "the checkpoint must be done within the notice's grace, else the retry "
                 "resumes from the latest valid checkpoint")
    return text + "."


def _backoff_sentence(rule: Rule) -> str:
    b = rule.backoff
    if b.initial == 0:
        return "It tries again at once."
    if b.multiplier == 1:
        return f"It waits {humanize(b.initial)} before trying again."
    return (f"It waits {humanize(b.initial)} before trying again, {b.multiplier:g} times longer "
            f"after each repeat, at most {humanize(b.max)}.")


def _channel_sentence(e: Escalation) -> str:
    if e.connection:
        where = f" and are POSTed to Airflow connection {e.connection}"
    elif e.webhook:
        where = f" and are POSTed to {redact(e.webhook)}"
    else:
        return "Notifications go to the task log."
    return (f"Notifications go to the task log{where} (up to {e.attempts} tries; a failed "
            "delivery is recorded with the decision, never stops it).")


def _unattended_sentence(d: Detection) -> str:
    if d.stop_unattended_after is None:
        return ("When Airflow cannot act on a detected fault (its scheduler is down), the faulty "
                "workload keeps its nodes until it can (stop_unattended_after is off).")
    bound = d.stop_unattended_after + d.checkpoint_timeout + UNATTENDED_MARGIN_SECONDS
    return (
        "When Airflow cannot act on a detected fault (its scheduler is down), Relay still stops "
        f"the faulty workload {humanize(d.stop_unattended_after)} after detecting it, once a "
        "healthy rank has handed over its state (or the ranks drained to a checkpoint): within "
        f"{humanize(bound)} of the detection at most. The decision above is applied and "
        "recorded when Airflow resumes the task."
    )


def explain(loaded: LoadedPolicy) -> str:
    """Return the whole policy in plain sentences."""
    p = loaded.policy
    lines = [f"Policy {loaded.path} (sha256 {loaded.sha256[:12]}, version {p.version})"]
    if p.description:
        lines.append(p.description)
    observing = [k.value for k in FaultKind if rule_mode(p, k) == Mode.OBSERVE]
    if observing:
        lines.append(f"OBSERVE MODE for {', '.join(observing)}: for these faults Relay only "
                     "records the decision below and notifies; it does not act (a crash still "
                     "ends the job).")
    lines.append("")
    for kind in FaultKind:
        rule = p.rules.for_kind(kind)
        target = rule.escalate_to or p.escalation.target
        lines.append(f"When {fault_sentence(kind, p.detection)}:")
        if rule_mode(p, kind) == Mode.OBSERVE:
            lines.append(f"  OBSERVE ONLY: Relay records what it would do and notifies {target}; "
                         "the job keeps running. It would do this:")
        lines.append("  " + _action_sentence(kind, rule).format(target=target))
        if rule.action not in (Action.ESCALATE, Action.ABORT):
            lines.append("  " + _backoff_sentence(rule))
            if rule.max_attempts == 1:
                lines.append(f"  (max_attempts is 1, so in fact it stops at once and notifies "
                             f"{target}.)")
            else:
                lines.append(
                    f"  At the {ordinal(rule.max_attempts)} {kind.value} in the same segment, "
                    f"it stops and notifies {target}."
                )
        lines.append("")
    lines.append(
        f"Whatever the faults, a segment gets at most {p.max_attempts_per_segment} attempts; "
        f"then Relay stops and notifies {p.escalation.target}."
    )
    if p.nodes.when_too_few == "wait" and p.nodes.wait_up_to > 0:
        lines.append(
            "When fewer healthy nodes are left than a segment needs, Relay waits up to "
            f"{humanize(p.nodes.wait_up_to)} for a quarantine to end, then stops and notifies "
            f"{p.escalation.target}."
        )
    else:
        lines.append("When fewer healthy nodes are left than a segment needs, Relay stops and "
                     f"notifies {p.escalation.target} at once.")
    lines.append(_unattended_sentence(p.detection))
    lines.append(_channel_sentence(p.escalation))
    lines.append(f"Every decision records this policy's sha256 ({loaded.sha256}).")
    return "\n".join(lines)


def explain_job(spec: JobSpec) -> str:
    """Return how a job checkpoints; for ``auto``, what an attempt starting now would pick."""
    from relay.lineage.interval import explain_text, interval_for

    choice = None
    if spec.checkpoint_auto is not None:
        try:
            from relay.lineage.store import Lineage

            choice = interval_for(spec, Lineage.from_settings())
        except Exception as exc:  # noqa: BLE001 - the explanation stands without the record
            return explain_text(spec) + f"\n  (the job's MLflow record could not be read: {exc})"
    return explain_text(spec, choice)
