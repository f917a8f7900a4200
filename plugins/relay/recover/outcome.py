"""Apply a decision: drain a checkpoint, stop, quarantine, roll back, record.

Retries go through Airflow's own machinery: :class:`SegmentFaultError` carries
the decision and :class:`PolicyRetry` (the segment tasks' ``retry_policy``)
turns it into Airflow's retry-with-delay or fail-now, so every attempt shows
in the Airflow UI with the policy's backoff.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk.definitions.retry_policy import RetryDecision, RetryPolicy

from relay.core.faults import Fault, FaultKind
from relay.launchers import Launcher
from relay.nodes.pool import NodePool
from relay.policy.decide import Decision

log = logging.getLogger(__name__)
ATTEMPT_DIR = re.compile(r"try-(\d+)")  # an attempt folder; renamed stale ones never match


def attempt_dirs(segment_dir: Path) -> list[Path]:
    """Return a segment's attempt folders (``try-N`` exactly), in attempt order."""
    found = [(int(m.group(1)), p) for p in segment_dir.glob("try-*")
             if (m := ATTEMPT_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _n, p in sorted(found)]


def faults_by_attempt(segment_dir: Path, exclude: Path | None = None) -> dict[str, FaultKind]:
    """Return, per attempt folder (oldest first), the fault kind its ``decision.json`` names.

    What this machine's folders say (written, fsynced, before anything else records the
    decision); decisions count from :func:`relay.recover.journal.fault_history`, which adds what
    the task state store lists. A folder set aside as ``try-N.stale-T`` (the same try
    launched again) is never counted.
    """
    kinds = {}
    for folder in attempt_dirs(segment_dir):
        record = folder / "decision.json"
        if folder == exclude or not record.exists():
            continue
        try:
            kinds[str(folder)] = FaultKind(json.loads(record.read_text())["fault"]["kind"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("Unreadable earlier decision %s; not counted", record)
    return kinds


class SegmentFaultError(Exception):
    """A segment attempt met a fault; ``decision`` says whether and when to retry."""

    def __init__(self, message: str, decision: Decision) -> None:
        super().__init__(message)
        self.decision = decision


class PolicyRetry(RetryPolicy):
    """Let the recovery policy's decision pick Airflow's retry delay, or fail now."""

    def evaluate(
        self,
        exception: BaseException,
        try_number: int,
        max_tries: int,
        context: Any = None,  # noqa: ANN401
    ) -> RetryDecision:
        """Map a SegmentFaultError's decision onto Airflow's retry."""
        decision = getattr(exception, "decision", None)
        if not isinstance(decision, Decision):
            return RetryDecision.default()
        if not decision.retry:
            return RetryDecision.fail(reason=decision.reason)
        return RetryDecision.retry(
            delay=timedelta(seconds=decision.backoff_seconds), reason=decision.reason
        )

    def serialize(self) -> dict[str, Any]:
        """Return the (stateless) policy for DAG serialization."""
        return {"__relay__": "PolicyRetry"}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> PolicyRetry:
        """Rebuild from :meth:`serialize`."""
        return cls()


def quarantine(decision: Decision, fault: Fault, where: str,
               launcher: Launcher | None = None) -> None:
    """Keep the culprit's node out, if the decision says so, and have the launcher enforce it."""
    if not (decision.quarantine_node and decision.quarantine_seconds):
        return
    pool = NodePool()
    try:
        pool.quarantine(
            decision.quarantine_node,
            decision.quarantine_seconds,
            reason=f"{fault.kind.value}: {fault.evidence.get('summary', '')}",
            by=f"{decision.rule} (policy {decision.policy_sha256[:12]}) in {where}",
        )
    except ValueError as exc:  # a host the pool does not list: record it, keep deciding
        log.error("Quarantine of %s not recorded: %s. Add it to RELAY_NODES.",
                  decision.quarantine_node, exc)
        return
    if launcher is not None:
        launcher.enforce_quarantines(pool.quarantines())
