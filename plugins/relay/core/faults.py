"""The fault taxonomy, and classification of what the watcher observes.

Pure functions over observations (launcher status now; heartbeats next), so
that the trigger only gathers facts and this module decides what they mean.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from relay.launchers.base import LaunchState, LaunchStatus
from relay_train.protocol.routes import NodeState


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


# After these the other ranks are healthy and merely waiting in a collective, holding
# state complete up to the last finished step: Relay asks one for it (relay.recover.ask_rescue).
RESCUABLE = frozenset({FaultKind.HANG, FaultKind.RANK_UNRESPONSIVE, FaultKind.NODE_UNRESPONSIVE})


@dataclass(frozen=True)
class Fault:
    """A classified fault: what, who, why we think so, and when we knew."""

    kind: FaultKind
    culprit_rank: int | None
    culprit_node: str | None
    evidence: dict[str, Any] = field(default_factory=dict)
    detected_at: float = field(default_factory=time.time)

    def describe(self) -> str:
        """Return one line for the task log and the failure message."""
        who = []
        if self.culprit_node is not None:
            who.append(f"node {self.culprit_node}")
        if self.culprit_rank is not None:
            who.append(f"rank {self.culprit_rank}")
        culprit = ", ".join(who) or "job-wide"
        return f"{self.kind.value} ({culprit}): {self.evidence.get('summary', '')}".rstrip(": ")

    def to_event(self) -> dict[str, Any]:
        """Return the trigger-event payload."""
        payload = asdict(self)
        payload["kind"] = self.kind.value
        return {"status": "fault", "fault": payload}

    @classmethod
    def from_event(cls, payload: dict[str, Any]) -> Fault:
        """Rebuild a fault from :meth:`to_event`'s ``fault`` payload."""
        return cls(**{**payload, "kind": FaultKind(payload["kind"])})


# How the peers of a dead rank end: gloo's "connection reset" (exit 1) or their agent's
# SIGTERM (-15). The culprit is the rank that died of something else.
SECONDARY_EXIT_CODES = frozenset({1, -15})


def only_secondary_exits(status: LaunchStatus) -> bool:
    """Return whether every failed rank so far ended like a peer of the culprit, not like one."""
    failed = status.failed_ranks()
    return bool(failed) and all(c in SECONDARY_EXIT_CODES for c in failed.values())


def classify_exit(status: LaunchStatus, node_ranks: dict[str, list[int]]) -> Fault | None:
    """Turn a failed launch status into a crash fault naming the first culprit."""
    if status.state is not LaunchState.FAILED:
        return None
    failed = status.failed_ranks()
    # A SIGKILLed or crashed rank takes its peers down with "connection reset"
    # (exit 1) or its agent's SIGTERM (-15); the culprit is the rank that died
    # of something else.
    primary = {r: c for r, c in failed.items() if c not in SECONDARY_EXIT_CODES}
    culprit_rank = min(primary or failed) if failed else None
    culprit_node = next(
        (n for n, ranks in node_ranks.items() if culprit_rank in ranks), None
    )
    if culprit_node is None:
        culprit_node = next(
            (n.node for n in status.nodes.values() if n.state == NodeState.FAILED), None)
    details = {n.node: n.detail for n in status.nodes.values() if n.detail}
    summary = (
        f"rank {culprit_rank} exited with code {failed[culprit_rank]}"
        if culprit_rank is not None
        else f"node agent failed: {details}"
    )
    evidence: dict[str, Any] = {"summary": summary, "exit_codes": failed, "agents": details}
    error = status.errors().get(culprit_rank) if culprit_rank is not None else None
    if error:
        last = next((line for line in reversed(error.splitlines()) if line.strip()), "")
        evidence["summary"] = f"{summary}: {last.strip()}"
        evidence["log_tail"] = error
    return Fault(
        kind=FaultKind.CRASH,
        culprit_rank=culprit_rank,
        culprit_node=culprit_node,
        evidence=evidence,
    )
