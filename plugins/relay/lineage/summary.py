"""``lineage.json``: a DAG run's checkpoint chain as machine-readable fields, not display text."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from relay.lineage.store import TAG_SEGMENT, TAG_TRY, Lineage
from relay_train.protocol.manifest import CheckpointManifest, CheckpointRef

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


def log_report_pictures(lineage: Lineage, parent_run_id: str) -> None:
    """Log the run's timeline and loss PNGs to its MLflow run (a failure only warns)."""
    from relay.lineage.report_files import log_pictures, render
    from relay.lineage.run_view import run_view
    try:
        with tempfile.TemporaryDirectory() as tmp:
            written = render(run_view(lineage, parent_run_id), lineage, Path(tmp))
            log_pictures(lineage, parent_run_id, written)
    except Exception:  # noqa: BLE001 - pictures are a convenience; the run's record stands
        log.warning("Could not log the report pictures to run %s", parent_run_id, exc_info=True)
