"""What a finished DAG run leaves on its MLflow run: ``lineage.json`` (the checkpoint chain
as machine-readable fields, not display text), summary metrics and tags (its faults, lost
steps, time lost, ETTR), and the report's pictures."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.lineage.store import TAG_SEGMENT, TAG_TRY, Lineage
from relay.lineage.tags import TAG_FAULTS
from relay_train.protocol.manifest import CheckpointManifest, CheckpointRef

if TYPE_CHECKING:
    from relay.lineage.run_view import RunView

log = logging.getLogger(__name__)
LINEAGE_VERSION = 2


def _ref(ref: CheckpointRef | None) -> dict[str, Any] | None:
    return None if ref is None else {"run_id": ref.run_id, "step": ref.step, "sha256": ref.sha256}


def lineage_record(lineage: Lineage, parent_run_id: str,
                   chain: list[CheckpointManifest]) -> dict[str, Any]:
    """Return the chain (newest first) with each checkpoint's segment and attempt."""
    attempts = {
        run.info.run_id: (int(run.data.tags.get(TAG_SEGMENT, -1)),
                          int(run.data.tags.get(TAG_TRY, 0)))
        for run in lineage.child_runs(parent_run_id)
    }
    entries = []
    for m in chain:
        segment, attempt = attempts.get(m.run_id, (None, None))
        entries.append({
            "step": m.step, "sha256": m.sha256, "run_id": m.run_id, "parent": _ref(m.parent),
            "origin": m.origin, "segment": segment, "attempt": attempt,
            "size_bytes": m.size_bytes, "world_size": m.world_size, "created_at": m.created_at,
        })
    return {
        "version": LINEAGE_VERSION,
        "parent_run_id": parent_run_id,
        "final": _ref(chain[0].ref) if chain else None,
        # Kept for readers of version 1: "run:<id>/step-N" style text.
        "final_checkpoint": str(chain[0].ref) if chain else None,
        "final_step": chain[0].step if chain else None,
        "chain": entries,
    }


def summary_metrics(view: RunView) -> tuple[dict[str, float], dict[str, str]]:
    """Return a DAG run's summary metrics (faults by kind, lost steps, time lost, ETTR) and
    its ``relay.faults`` tag ("hang:1,crash:2", or "none")."""
    by_kind: dict[str, int] = {}
    for row in view.faults:
        by_kind[row.kind] = by_kind.get(row.kind, 0) + 1
    lost_by_kind = view.goodput.get("lost_seconds_by_fault", {})
    metrics: dict[str, float] = {
        "faults": float(len(view.faults)),
        "lost_steps": float(sum(r.lost_steps or 0 for r in view.faults)),
        "time_lost_seconds": float(sum(lost_by_kind.values())),
        "ettr": float(view.goodput.get("ettr", 0.0)),
        **{f"faults.{kind}": float(n) for kind, n in by_kind.items()},
        **{f"time_lost_seconds.{kind}": float(v) for kind, v in lost_by_kind.items()},
    }
    tag = ",".join(f"{kind}:{n}" for kind, n in sorted(by_kind.items())) or "none"
    return metrics, {TAG_FAULTS: tag}


def log_run_summary(lineage: Lineage, parent_run_id: str) -> None:
    """Log a DAG run's summary metrics, tags and pictures to its MLflow run (a failure only
    warns: the run's record stands without them)."""
    from relay.lineage.run_view import run_view
    try:
        view = run_view(lineage, parent_run_id)
        metrics, tags = summary_metrics(view)
        lineage.log_metrics(parent_run_id, metrics)
        lineage.set_tags(parent_run_id, tags)
    except Exception:  # noqa: BLE001 - a summary is a view; the run's record stands
        log.warning("Could not log the summary of run %s", parent_run_id, exc_info=True)
        return
    log_report_pictures(lineage, parent_run_id, view)


def log_report_pictures(lineage: Lineage, parent_run_id: str, view: RunView | None = None) -> None:
    """Log the run's timeline and loss PNGs to its MLflow run (a failure only warns)."""
    from relay.lineage.report_files import log_pictures, render
    from relay.lineage.run_view import run_view
    try:
        with tempfile.TemporaryDirectory() as tmp:
            written = render(view or run_view(lineage, parent_run_id), lineage, Path(tmp))
            log_pictures(lineage, parent_run_id, written)
    except Exception:  # noqa: BLE001 - pictures are a convenience; the run's record stands
        log.warning("Could not log the report pictures to run %s", parent_run_id, exc_info=True)
