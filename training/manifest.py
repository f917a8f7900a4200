"""Checkpoint manifests and their artifact layout, shared by workers and Relay.

Stdlib only: the Airflow side reads manifests without importing torch. A
checkpoint counts only once its manifest is logged, and the manifest is always
logged after the checkpoint file it describes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

CHECKPOINT_ROOT = "checkpoints"
CHECKPOINT_FILE = "checkpoint.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1


def step_dir(step: int) -> str:
    """Return the stable, sortable artifact folder of the checkpoint at ``step``."""
    return f"{CHECKPOINT_ROOT}/step-{step:08d}"


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Return the hex sha256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class CheckpointRef:
    """Where a checkpoint lives: the MLflow run that logged it and its step."""

    run_id: str
    step: int
    sha256: str

    @property
    def artifact_dir(self) -> str:
        """Return the checkpoint's artifact folder inside its run."""
        return step_dir(self.step)

    def __str__(self) -> str:
        return f"runs:/{self.run_id}/{self.artifact_dir} (sha256 {self.sha256[:12]})"


@dataclass(frozen=True)
class CheckpointManifest:
    """What a checkpoint is, and which checkpoint it grew from."""

    step: int
    sha256: str
    size_bytes: int
    world_size: int
    job: str
    run_id: str
    parent: CheckpointRef | None
    created_at: float
    version: int = MANIFEST_VERSION
    # "periodic": the training loop's own (its schedule, or a drain); otherwise how it was
    # made, e.g. "rescued from rank 2 after hang": a healthy rank's state after a fault.
    origin: str = "periodic"

    @property
    def ref(self) -> CheckpointRef:
        """Return a reference to this checkpoint."""
        return CheckpointRef(run_id=self.run_id, step=self.step, sha256=self.sha256)

    def to_json(self) -> str:
        """Serialise the manifest."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CheckpointManifest:
        """Parse a manifest; raise ``ValueError`` when it is not one."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError(f"expected a JSON object, found {type(raw).__name__}")
            parent = raw.get("parent")
            return cls(
                step=int(raw["step"]),
                sha256=str(raw["sha256"]),
                size_bytes=int(raw["size_bytes"]),
                world_size=int(raw["world_size"]),
                job=str(raw["job"]),
                run_id=str(raw["run_id"]),
                parent=CheckpointRef(**parent) if parent else None,
                created_at=float(raw["created_at"]),
                version=int(raw.get("version", MANIFEST_VERSION)),
                origin=str(raw.get("origin", "periodic")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a Relay checkpoint manifest: {exc}") from exc
