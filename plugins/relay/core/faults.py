"""The fault taxonomy: every kind of fault Relay tells apart, and the one :class:`Fault`.

The watcher (:mod:`relay.watch.detection`) makes them; the policy decides on them;
the recovery pipeline acts on them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from relay.core.attempt import AttemptState


class FaultKind(StrEnum):
    """Every kind of fault Relay tells apart."""

    HANG = "hang"
    RANK_UNRESPONSIVE = "rank_unresponsive"
    NODE_UNRESPONSIVE = "node_unresponsive"
    STRAGGLER = "straggler"
    THROUGHPUT_DEGRADED = "throughput_degraded"
    CRASH = "crash"
    LAUNCH_FAILURE = "launch_failure"
    NAN_LOSS = "nan_loss"
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    # A rank's script returned (exit 0) before its segment's end: the job's configuration or
    # script is wrong, and the same launch would end the same way; never retried.
    SHORT_SEGMENT = "short_segment"
    # The platform takes a healthy node back after a grace (a Kubernetes eviction, Slurm's
    # --signal=TERM@N, a spot reclaim): drain within the grace, retry elsewhere, never
    # quarantine the node.
    PREEMPTED = "preempted"


# After these the other ranks are healthy and merely waiting in a collective, holding
# state complete up to the last finished step: Relay asks one for it (relay.recover.ask_rescue).
RESCUABLE = frozenset({FaultKind.HANG, FaultKind.RANK_UNRESPONSIVE, FaultKind.NODE_UNRESPONSIVE})
# Faults of the job's own configuration or script: a retry would meet them again.
NOT_RETRYABLE = frozenset({FaultKind.SHORT_SEGMENT})
# The key in a fault's evidence saying how its culprit was checked, with a "note" the
# decision's reason quotes: a hang's against the ranks' stacks (relay.recover.culprit), a
# launch failure's rendezvous port found taken (relay.watch.exits).
CULPRIT_CHECK = "culprit_check"


@dataclass(frozen=True)
class Fault:
    """A classified fault: what, who, why we think so, and when we knew."""

    kind: FaultKind
    culprit_rank: int | None
    culprit_node: str | None
    evidence: dict[str, Any] = field(default_factory=dict)
    detected_at: float = field(default_factory=time.time)

    @property
    def culprit(self) -> str:
        """Return who faulted, e.g. ``node node-b, rank 3`` (``job-wide``: no one in particular)."""
        who = []
        if self.culprit_node is not None:
            who.append(f"node {self.culprit_node}")
        if self.culprit_rank is not None:
            who.append(f"rank {self.culprit_rank}")
        return ", ".join(who) or "job-wide"

    def describe(self) -> str:
        """Return the fault and its evidence's summary, on one line."""
        summary = self.evidence.get("summary", "")
        return f"{self.kind.value} ({self.culprit}): {summary}".rstrip(": ")

    def to_event(self) -> dict[str, Any]:
        """Return the trigger-event payload."""
        payload = asdict(self)
        payload["kind"] = self.kind.value
        return {"status": AttemptState.FAULTED.value, "fault": payload}

    @classmethod
    def from_event(cls, payload: dict[str, Any]) -> Fault:
        """Rebuild a fault from :meth:`to_event`'s ``fault`` payload."""
        return cls(**{**payload, "kind": FaultKind(payload["kind"])})
