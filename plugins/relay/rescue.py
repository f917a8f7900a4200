"""Ask a healthy rank for its in-memory state before stopping a faulty attempt.

After a hang or an unresponsive rank or node, the healthy ranks wait in the
step's collective with weights complete up to the last finished step. One of
them writes that state next to the attempt (see :mod:`relay_train.rescue`);
after the workload is stopped Relay verifies it and publishes it to the
attempt's MLflow run as a checkpoint like any other, whose manifest says where
it came from. The retry then resumes from it, and the steps since the last
periodic checkpoint are not lost. If no rank answers in time, nothing changes:
the retry resumes from the last periodic checkpoint, as it would have anyway.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from relay.faults import RESCUABLE, Fault, FaultKind
from relay_train.heartbeat import Heartbeat, read_heartbeats, write_atomically
from relay_train.launch import LaunchConfig
from relay_train.manifest import CheckpointManifest, CheckpointRef, file_sha256
from relay_train.rescue import ACK_FILE, DONE_FILE, REQUEST_FILE, RESCUE_DIR, RescueResult

log = logging.getLogger(__name__)

ACK_TIMEOUT_SECONDS = 2.0  # a healthy rank's thread answers within a poll (0.1s)


def donor(fault: Fault, cfg: LaunchConfig, beats: dict[int, Heartbeat]) -> int | None:
    """Return the healthy rank to ask: not the culprit, not on a silent node, furthest along."""
    if fault.kind not in RESCUABLE:
        return None
    excluded = {fault.culprit_rank} if fault.culprit_rank is not None else set()
    if fault.kind is FaultKind.NODE_UNRESPONSIVE and fault.culprit_node in cfg.nodes:
        excluded |= {cfg.global_rank(fault.culprit_node, r) for r in range(cfg.ranks_per_node)}
    candidates = [b for r, b in beats.items() if r not in excluded and b.nonfinite_step is None]
    if not candidates:
        return None
    return min(candidates, key=lambda b: (-b.step, b.rank)).rank


def _wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def request_rescue(
    attempt_dir: Path, cfg: LaunchConfig, fault: Fault, timeout_seconds: float
) -> RescueResult | None:
    """Ask one healthy rank for its state; return the verified result, or None."""
    rank = donor(fault, cfg, read_heartbeats(attempt_dir / "heartbeats"))
    if rank is None:
        return None
    folder = attempt_dir / RESCUE_DIR
    folder.mkdir(exist_ok=True)
    asked = time.monotonic()
    write_atomically(folder / REQUEST_FILE, json.dumps(
        {"rank": rank, "fault": fault.kind.value, "at": time.time()}))
    if not _wait_for(folder / ACK_FILE, ACK_TIMEOUT_SECONDS):
        log.warning("Rank %d did not answer the rescue request in %.0fs; resuming from the last "
                    "checkpoint instead", rank, ACK_TIMEOUT_SECONDS)
        return None
    if not _wait_for(folder / DONE_FILE, timeout_seconds):
        log.warning("Rank %d did not finish handing over its state in %.0fs; resuming from the "
                    "last checkpoint instead", rank, timeout_seconds)
        return None
    try:
        result = RescueResult.read(folder / DONE_FILE)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("Unreadable rescue record %s (%s); resuming from the last checkpoint",
                    folder / DONE_FILE, exc)
        return None
    if result.refused or result.path is None or result.step is None:
        log.warning("Rank %d refused to hand over its state: %s", rank, result.refused)
        return None
    if file_sha256(Path(result.path)) != result.sha256:
        log.warning("Rescued state %s does not match the sha256 rank %d reported; not used",
                    result.path, rank)
        return None
    log.info("Rank %d handed over its state at step %d in %.2fs", rank, result.step,
             time.monotonic() - asked)
    return result


def publish_rescue(
    result: RescueResult, cfg: LaunchConfig, fault: Fault, parent: CheckpointRef | None
) -> CheckpointManifest:
    """Log the rescued checkpoint to the attempt's MLflow run; return its manifest."""
    from relay_train.publish import MlflowCheckpointSink  # MLflow: only once there is one

    assert result.path is not None and result.step is not None and result.sha256 is not None
    manifest = CheckpointManifest(
        step=result.step, sha256=result.sha256, size_bytes=int(result.size_bytes or 0),
        world_size=cfg.world_size, job=cfg.job, run_id=cfg.run_id, parent=parent,
        created_at=time.time(), origin=f"rescued from rank {result.rank} after {fault.kind.value}",
    )
    MlflowCheckpointSink(cfg.tracking_uri, cfg.run_id).publish(Path(result.path), manifest)
    return manifest
