"""A signed checkpoint published to a real MLflow store, as a rank publishes one."""

from __future__ import annotations

import time
from pathlib import Path

from relay.core.checkpoint_keys import checkpoint_keys
from relay.lineage.store import Lineage
from relay_train.checkpoints.publish import MlflowCheckpointSink
from relay_train.protocol.manifest import CHECKPOINT_FILE, CheckpointManifest, file_sha256
from relay_train.protocol.signing import sign


def publish_checkpoint(lineage: Lineage, run_id: str, step: int, folder: Path) -> None:
    """Write a small checkpoint file for ``step`` under ``folder`` and publish it, signed."""
    path = folder / f"state-{step}" / CHECKPOINT_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(f"weights after step {step}".encode())
    manifest = CheckpointManifest(step=step, sha256=file_sha256(path),
                                  size_bytes=path.stat().st_size, world_size=2, job="t",
                                  run_id=run_id, parent=None, created_at=time.time())
    signed = sign(manifest, checkpoint_keys())  # as the ranks sign theirs
    MlflowCheckpointSink(lineage.tracking_uri, run_id).publish(path, signed)
