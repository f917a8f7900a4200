"""The policy's recovery rules: one per fault kind, and what each may say.

Read by governance owners, so every field has a plain meaning:

- ``action``: what to do about the fault (see :class:`Action`).
- ``max_attempts``: how many times this kind of fault may strike one segment
  before Relay stops trying and escalates.
- ``backoff``: wait before the next attempt; ``5s``, or
  ``{initial: 5s, multiplier: 2, max: 2m}`` to grow it with each repeat.
- ``quarantine``: keep the culprit node out of every job for this long
  (``null``: never).
- ``escalate_to``: who is told when Relay gives up (default: the policy's
  ``escalation.target``).
- ``mode``: ``observe`` records and notifies what the rule would do without
  doing it; ``enforce`` acts (default: the policy's ``mode``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from relay.core.faults import NOT_RETRYABLE, FaultKind
from relay.spec.yamlsource import (
    DURATION_JSON_SCHEMA,
    FROZEN,
    Duration,
    FieldValueError,
    parse_duration,
)

MAX_ESCALATION_TIMEOUT_SECONDS = 60.0  # one delivery try waits at most this long
_OPTIONAL_SECONDS: dict[str, Any] = {"anyOf": [*DURATION_JSON_SCHEMA["anyOf"], {"type": "null"}],
                                     "description": "a duration such as 30m, or null for none"}


class Mode(StrEnum):
    """Whether a rule acts on its decisions or only records them."""

    ENFORCE = "enforce"  # apply the decision: stop, quarantine, retry, escalate
    OBSERVE = "observe"  # record the decision Relay would make and notify; leave the job alone


class Action(StrEnum):
    """What a rule does about a fault."""

    RETRY = "retry"
    RESTART_ELSEWHERE = "restart_elsewhere"
    CHECKPOINT_AND_MIGRATE = "checkpoint_and_migrate"
    ROLLBACK = "rollback"
    ESCALATE = "escalate"
    ABORT = "abort"


ACTION_MEANING = {
    Action.RETRY: "run the segment again from its latest valid checkpoint, on the same nodes",
    Action.RESTART_ELSEWHERE: "run the segment again from its latest valid checkpoint on "
    "healthy nodes, without the culprit's node",
    Action.CHECKPOINT_AND_MIGRATE: "have the healthy ranks take a checkpoint first (no steps "
    "lost), then run the segment on healthy nodes without the culprit's node",
    Action.ROLLBACK: "discard the newest checkpoint and run the segment again from the one "
    "before it",
    Action.ESCALATE: "stop the segment for good and notify the escalation target",
    Action.ABORT: "stop the segment for good, without retrying",
}

# Faults whose ranks are all alive when detected, so they can still checkpoint.
CAN_CHECKPOINT = frozenset({FaultKind.STRAGGLER, FaultKind.THROUGHPUT_DEGRADED,
                            FaultKind.PREEMPTED})
# Faults with no culprit node: nothing to move away from or to quarantine.
JOB_WIDE = frozenset({FaultKind.THROUGHPUT_DEGRADED, FaultKind.CORRUPT_CHECKPOINT})
# Faults whose culprit node is healthy (its platform took it back): the next attempt runs
# without it, and nothing quarantines it.
HEALTHY_NODE = frozenset({FaultKind.PREEMPTED})


class Backoff(BaseModel):
    """How long to wait before the next attempt, growing with each repeat of the fault."""

    model_config = FROZEN

    initial: Duration = 0.0
    multiplier: float = Field(1.0, ge=1.0)
    max: Duration = 3600.0

    def seconds(self, repeat: int) -> float:
        """Return the wait before attempt number ``repeat + 1`` (``repeat`` >= 1)."""
        try:
            grown = self.initial * self.multiplier ** max(repeat - 1, 0)
        except OverflowError:
            return self.max
        return min(self.max, grown)


class Rule(BaseModel):
    """What happens when one kind of fault strikes a segment."""

    model_config = FROZEN

    action: Action
    max_attempts: int = Field(3, ge=1, strict=True)
    backoff: Annotated[
        Backoff,
        WithJsonSchema({"anyOf": [DURATION_JSON_SCHEMA, Backoff.model_json_schema()]}),
    ] = Backoff()
    quarantine: Annotated[float | None, WithJsonSchema(_OPTIONAL_SECONDS)] = None
    escalate_to: str | None = None
    mode: Mode | None = None  # None: the policy's mode

    @field_validator("backoff", mode="before")
    @classmethod
    def _shorthand(cls, value: object) -> object:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return {"initial": value}
        return value

    @field_validator("quarantine", mode="before")
    @classmethod
    def _quarantine(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)


def _shown_url(url: str) -> str:
    """Return a URL without its user, password and query (never echo a secret)."""
    from relay.core.urls import redact

    return repr(redact(url))


class Escalation(BaseModel):
    """Who is told when Relay gives up, and how.

    ``connection`` names an Airflow connection (its token stays in Airflow's
    secrets); ``webhook`` is a plain http(s) URL. Delivery is tried up to
    ``attempts`` times, each waiting up to ``timeout`` (at most a minute).
    """

    model_config = FROZEN

    target: str = "ml-platform-oncall"
    webhook: str | None = None
    connection: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    attempts: int = Field(3, ge=1, le=10, strict=True)
    timeout: Duration = Field(10.0, gt=0, le=MAX_ESCALATION_TIMEOUT_SECONDS)

    @field_validator("webhook", mode="after")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        try:
            parts = urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            ok = False
        if not ok:
            raise FieldValueError(
                "an http(s) URL such as https://hooks.example.com/relay", url,
                "write the full http:// or https:// URL, or better, keep the URL and its token in "
                "an Airflow connection and set escalation.connection: <conn id> instead",
                shown=_shown_url(url),
            )
        return url

    @field_validator("connection", mode="after")
    @classmethod
    def _one_channel(cls, conn: str | None, info: ValidationInfo) -> str | None:
        if conn is not None and info.data.get("webhook") is not None:
            raise FieldValueError(
                "either webhook or connection", f"connection {conn!r} and a webhook",
                "remove escalation.webhook; the connection says where to POST",
            )
        return conn


class NodeRules(BaseModel):
    """What to do when too few healthy nodes are left for a segment."""

    model_config = FROZEN

    when_too_few: str = Field("wait", pattern="^(wait|escalate)$")
    wait_up_to: Duration = 300.0


class Rules(BaseModel):
    """One rule per fault kind; every kind must be covered (short_segment defaults to abort)."""

    model_config = FROZEN

    hang: Rule
    rank_unresponsive: Rule
    node_unresponsive: Rule
    straggler: Rule
    throughput_degraded: Rule
    crash: Rule
    launch_failure: Rule
    nan_loss: Rule
    corrupt_checkpoint: Rule
    # A kind added after policies were written: a policy without it still loads, and a
    # short segment aborts (the only safe answer; `relay policy explain` shows it).
    short_segment: Rule = Field(default_factory=lambda: Rule(action=Action.ABORT))
    # Likewise: a policy without it drains the preempted attempt and moves on.
    preempted: Rule = Field(default_factory=lambda: Rule(
        action=Action.CHECKPOINT_AND_MIGRATE, max_attempts=5))

    @field_validator(*(k.value for k in FaultKind), mode="after")
    @classmethod
    def _action_fits_fault(cls, rule: Rule, info: ValidationInfo) -> Rule:
        """Reject rules that cannot work for their fault kind, at the rule's own line."""
        kind = FaultKind(info.field_name)
        moves = rule.action in (Action.RESTART_ELSEWHERE, Action.CHECKPOINT_AND_MIGRATE)
        found = f"{kind.value}: action {rule.action.value}"
        if kind in NOT_RETRYABLE and rule.action not in (Action.ABORT, Action.ESCALATE):
            raise FieldValueError(
                "abort or escalate", found,
                f"a {kind.value} fault comes from the job's own script or configuration, and a "
                "retry would end the same way; use action: abort (or escalate to tell someone)",
            )
        if kind is FaultKind.CORRUPT_CHECKPOINT and moves:
            raise FieldValueError(
                "rollback, escalate or abort", found,
                "a corrupt checkpoint is not a node's fault; use action: rollback",
            )
        if rule.action is Action.CHECKPOINT_AND_MIGRATE and kind not in CAN_CHECKPOINT:
            raise FieldValueError(
                "an action that works without every rank alive", found,
                f"a {kind.value} fault leaves a rank unable to take part in a checkpoint; "
                "use action: restart_elsewhere",
            )
        if rule.quarantine is not None and kind in HEALTHY_NODE:
            raise FieldValueError(
                "no quarantine", f"{kind.value}: quarantine set",
                "a preempted node is healthy (its platform took it back); the next attempt "
                "runs without it anyway. Remove quarantine")
        if moves and kind not in JOB_WIDE | HEALTHY_NODE and rule.quarantine is None:
            raise FieldValueError(
                "a quarantine duration", f"{found} without quarantine",
                f"{rule.action.value} keeps the culprit's node out, so say for how long, "
                "e.g. quarantine: 30m",
            )
        if rule.quarantine is not None and kind in JOB_WIDE:
            raise FieldValueError("no quarantine", f"{kind.value}: quarantine set",
                                  f"a {kind.value} fault names no culprit node; remove quarantine")
        if rule.quarantine is not None and not moves:
            raise FieldValueError(
                "no quarantine", f"{found} with quarantine",
                f"{rule.action.value} does not move the job, so nothing would avoid the "
                "quarantined node during the next attempt; use action: restart_elsewhere, or "
                "remove quarantine",
            )
        return rule

    def for_kind(self, kind: FaultKind) -> Rule:
        """Return the rule for ``kind``."""
        return getattr(self, kind.value)
