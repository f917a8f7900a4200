"""Record a decision in MLflow without ever letting MLflow undo it.

The decision is already made, applied and on disk (``decision.json`` in the
attempt folder, fsynced) when these run. Lineage retries each MLflow call
within a bound; what still fails is logged once here and dropped, so a short
tracking-store outage never turns the policy's decision into Airflow's default
retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from relay.policy.observe import log_observations

log = logging.getLogger(__name__)
T = TypeVar("T")


def best_effort(what: str, work: Callable[[], T]) -> T | None:
    """Run an MLflow call whose failure must not undo a decision; None if it failed."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - logged once and dropped, by design
        log.error("Could not %s in MLflow after retries (%s: %s); dropped. The decision "
                  "stands and its record is in the attempt folder.", what,
                  type(exc).__name__, exc)
        return None


def record_fault(lineage: Any, run_id: str, attempt_dir: Path,  # noqa: ANN401
                 record: Mapping[str, Any], tags: Mapping[str, str],
                 observed: list[dict[str, Any]] | None = None) -> None:
    """Log the attempt's observations (``observed``: those the task state store keeps),
    fault and decision, and close its run as a fault."""
    best_effort("log the observations",
                lambda: log_observations(lineage, run_id, attempt_dir, observed))
    best_effort("log fault.json", lambda: lineage.log_json(run_id, "fault.json", record["fault"]))
    best_effort("log decision.json", lambda: lineage.log_json(run_id, "decision.json", record))
    best_effort("close the attempt run", lambda: lineage.finish_run(run_id, "fault", tags))
