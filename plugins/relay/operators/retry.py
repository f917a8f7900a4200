"""Airflow's retry, as the recovery policy decides it.

The recovery pipeline (:mod:`relay.recover.pipeline`) returns an outcome; the
segment task raises :class:`SegmentFaultError` carrying its decision when the
policy retries, and :class:`PolicyRetry` (the segment tasks' ``retry_policy``)
turns that into Airflow's retry-with-delay or fail-now, so every attempt shows
in the Airflow UI with the policy's backoff.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk.definitions.retry_policy import RetryDecision, RetryPolicy

from relay.policy.decide import Decision


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
