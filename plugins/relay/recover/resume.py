"""Where the retry resumes: the drained step, a rescued state newer than the latest
checkpoint, or the latest valid checkpoint (after a rollback, the one before it)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.core.checkpoint_keys import ring_for
from relay.core.faults import Fault
from relay.policy.decide import Decision
from relay.recover.ask_rescue import publish_rescue
from relay.recover.record import best_effort
from relay.recover.save_state import Saved
from relay_train.protocol.launch import LaunchConfig


def next_resume(lineage: Any, parent_run: Callable[[], str],  # noqa: ANN401
                decision: Decision, fault: Fault, cfg: LaunchConfig, saved: Saved,
                fence: str) -> tuple[int | None, dict[str, Any] | None]:
    """Return the step the retry resumes from (None where MLflow could not say), and the
    record of a rescued state published because it is newer than the latest checkpoint."""
    found = best_effort("find the resume point",
                        lambda: resume_point(lineage, parent_run(), decision, fault, cfg))
    latest = found[0] if found else None
    resumed = saved.drained_at if saved.drained_at is not None else (
        None if found is None else latest.manifest.step if latest else 0)
    rescued = saved.rescued
    if rescued is None or rescued.step is None or found is None or (
            resumed is not None and rescued.step <= resumed):
        return resumed, None
    manifest = best_effort("publish the rescued weights", lambda: publish_rescue(
        rescued, cfg, fault, latest.manifest.ref if latest else None))
    if manifest is None:
        return resumed, None
    best_effort("accept the rescued state", lambda: lineage.fence_attempt(
        cfg.run_id, fence, accept=(manifest.ref.artifact_dir.rsplit("/", 1)[-1],)))
    return manifest.step, {"rank": rescued.rank, "step": manifest.step,
                           "sha256": manifest.sha256, "seconds": round(rescued.seconds, 3),
                           "checkpoint": str(manifest.ref)}


def resume_point(lineage: Any, parent: str, decision: Decision,  # noqa: ANN401
                 fault: Fault, cfg: LaunchConfig) -> tuple[Any, list[Any]]:  # noqa: ANN401
    """Return where the next attempt resumes, rolling back first if the decision says so
    (checking signatures with the key ring the attempt was launched with)."""
    keys = ring_for(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        latest, corrupt = lineage.resume_point(parent, Path(tmp), keys)
        if decision.rollback and latest is not None:
            lineage.reject_checkpoint(latest.manifest, f"rollback after {fault.describe()}")
            latest, corrupt = lineage.resume_point(parent, Path(tmp), keys)
    return latest, corrupt
