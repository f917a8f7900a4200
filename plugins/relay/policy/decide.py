"""The decision engine: one pure function from (fault, history, policy) to a decision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from relay.core.faults import CULPRIT_CHECK, Fault, FaultKind
from relay.policy.rules import HEALTHY_NODE, Action, Mode


def ordinal(n: int) -> str:
    """Return 1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st, 22nd, ..."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


@dataclass(frozen=True)
class Decision:
    """What Relay does about one fault, and why (the rule and the policy that said so)."""

    kind: str
    action: str
    retry: bool
    backoff_seconds: float
    quarantine_node: str | None
    quarantine_seconds: float | None
    checkpoint_first: bool
    rollback: bool
    notify: str | None
    rule: str
    occurrence: int
    max_attempts: int
    policy_sha256: str
    reason: str
    observe: bool = False  # observe mode: recorded and notified, not applied
    # The node the next attempt runs without, that attempt only (a preempted node: healthy,
    # so not quarantined); a quarantined node is kept out by the pool instead.
    avoid_node: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Decision:
        """Rebuild from :meth:`to_dict` (records from before a field existed included)."""
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})


def rule_mode(policy: Any, kind: FaultKind) -> Mode:  # noqa: ANN401 - relay.policy.model.Policy
    """Return whether ``kind``'s rule acts or only observes (its own mode, else the policy's)."""
    return policy.rules.for_kind(kind).mode or policy.mode


def decide(
    fault: Fault,
    history: Sequence[FaultKind],
    policy: Any,  # noqa: ANN401 - relay.policy.model.Policy (import cycle)
    policy_sha256: str,
) -> Decision:
    """Decide what to do about ``fault``, given the faults earlier attempts of the segment met.

    Under observe mode the decision is the same, marked ``observe`` and addressed to the
    escalation target, so the applying side records and notifies it instead of acting.
    """
    decision = _enforced(fault, history, policy, policy_sha256)
    check = fault.evidence.get(CULPRIT_CHECK)  # stacks vs phases, a taken port
    if isinstance(check, dict) and check.get("note"):
        decision = replace(decision, reason=f"{decision.reason}; culprit: {check['note']}")
    if rule_mode(policy, fault.kind) != Mode.OBSERVE:
        return decision
    rule = policy.rules.for_kind(fault.kind)
    return replace(
        decision, observe=True, notify=decision.notify or rule.escalate_to
        or policy.escalation.target,
        reason=f"observe mode, not applied: Relay would {decision.action}: {decision.reason}",
    )


def _enforced(
    fault: Fault, history: Sequence[FaultKind], policy: Any, policy_sha256: str,  # noqa: ANN401
) -> Decision:
    rule = policy.rules.for_kind(fault.kind)
    occurrence = 1 + sum(1 for k in history if k == fault.kind)
    attempts_so_far = 1 + len(history)
    action = rule.action
    notify = rule.escalate_to or policy.escalation.target
    name = f"rules.{fault.kind.value}"
    base = {
        "kind": fault.kind.value, "rule": name, "occurrence": occurrence,
        "max_attempts": rule.max_attempts, "policy_sha256": policy_sha256,
    }
    nth = f"the {ordinal(occurrence)} {fault.kind.value} in this segment"

    def give_up(final: Action, why: str, to: str = notify) -> Decision:
        return Decision(
            action=final.value, retry=False, backoff_seconds=0.0, quarantine_node=None,
            quarantine_seconds=None, checkpoint_first=False, rollback=False,
            notify=to if final is Action.ESCALATE else None, reason=why, **base,
        )

    if action is Action.ABORT:
        return give_up(Action.ABORT, f"{name} says abort: stop the segment for good")
    if action is Action.ESCALATE:
        return give_up(Action.ESCALATE, f"{name} says escalate: stop and notify {notify}")
    if occurrence >= rule.max_attempts:
        return give_up(
            Action.ESCALATE,
            f"{nth} reaches {name}.max_attempts ({rule.max_attempts}): stop and notify {notify}",
        )
    if attempts_so_far >= policy.max_attempts_per_segment:
        return give_up(
            Action.ESCALATE,
            f"attempt {attempts_so_far} of this segment reaches max_attempts_per_segment "
            f"({policy.max_attempts_per_segment}): stop and notify {policy.escalation.target}",
            to=policy.escalation.target,
        )
    moves = action in (Action.RESTART_ELSEWHERE, Action.CHECKPOINT_AND_MIGRATE)
    node = fault.culprit_node if rule.quarantine is not None else None
    avoid = fault.culprit_node if moves and fault.kind in HEALTHY_NODE else None
    backoff = rule.backoff.seconds(occurrence)
    where = f" without {node or avoid}" if moves and (node or avoid) else ""
    return Decision(
        action=action.value, retry=True, backoff_seconds=backoff,
        quarantine_node=node,
        quarantine_seconds=rule.quarantine if node is not None else None,
        checkpoint_first=action is Action.CHECKPOINT_AND_MIGRATE,
        rollback=action is Action.ROLLBACK, notify=None,
        reason=f"{nth} (limit {rule.max_attempts}): {name} says {action.value}; "
        f"next attempt{where} in {backoff:g}s",
        avoid_node=avoid, **base,
    )
