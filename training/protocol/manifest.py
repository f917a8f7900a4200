"""Checkpoint manifests and their artifact layout, shared by workers and Relay.

Stdlib only: the Airflow side reads manifests without importing torch. A
checkpoint counts only once its manifest is logged, and the manifest is always
logged after the checkpoint file it describes.

Two formats: ``torch`` (one ``checkpoint.pt``, its sha256 in ``sha256``) and
``dcp`` (a ``torch.distributed.checkpoint`` folder ``dcp/``, a sha256 per file in
``files`` and, in ``sha256``, the digest of that table, so a parent reference
still names the checkpoint's exact bytes).

Every manifest is signed (``key_id``, ``signature``; see :mod:`relay_train.protocol.signing`):
an unsigned one, or one whose signature does not hold, is a corrupt checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHECKPOINT_ROOT = "checkpoints"
CHECKPOINT_FILE = "checkpoint.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
FORMAT_TORCH = "torch"  # one torch.save file, CHECKPOINT_FILE
FORMAT_DCP = "dcp"  # a torch.distributed.checkpoint folder, DCP_DIR
FORMATS = (FORMAT_TORCH, FORMAT_DCP)
DCP_DIR = "dcp"


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


def tree_sha256s(directory: Path) -> dict[str, str]:
    """Return the sha256 of every file under ``directory``, keyed by relative POSIX path."""
    return {
        path.relative_to(directory).as_posix(): file_sha256(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def files_digest(files: Mapping[str, str]) -> str:
    """Return one sha256 naming a whole table of ``{relative path: sha256}``."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class FileMismatch:
    """One file of a checkpoint folder that differs from its manifest."""

    path: str
    expected: str | None  # None: a file the manifest does not list
    found: str | None  # None: a listed file that is missing

    def __str__(self) -> str:
        if self.found is None:
            return f"{self.path}: missing (expected sha256 {self.expected})"
        if self.expected is None:
            return f"{self.path}: not in the manifest (found sha256 {self.found})"
        return f"{self.path}: expected sha256 {self.expected}, found {self.found}"


def tree_mismatches(
    directory: Path, files: Mapping[str, str], share: tuple[int, int] = (0, 1)
) -> list[FileMismatch]:
    """Compare a folder with its manifest's ``files`` (missing, extra or changed files).

    ``share=(i, n)`` checks only every n-th name from the i-th, so n ranks can split
    the hashing of one folder between them.
    """
    present = {
        p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()
    } if directory.is_dir() else set()
    index, count = share
    problems = []
    for name in sorted(present | set(files))[index::count]:
        expected = files.get(name)
        found = file_sha256(directory / name) if name in present else None
        if found != expected:
            problems.append(FileMismatch(name, expected, found))
    return problems


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
    format: str = FORMAT_TORCH
    # dcp only: {path relative to the dcp folder: sha256}; sha256 above is files_digest(files)
    files: dict[str, str] = field(default_factory=dict, hash=False)
    # The deployment key's id and the HMAC-SHA256 over every other field (signing.py).
    key_id: str = ""
    signature: str = ""

    @property
    def ref(self) -> CheckpointRef:
        """Return a reference to this checkpoint."""
        return CheckpointRef(run_id=self.run_id, step=self.step, sha256=self.sha256)

    @property
    def artifact(self) -> str:
        """Return the checkpoint's file (or DCP folder) inside its MLflow run."""
        name = DCP_DIR if self.format == FORMAT_DCP else CHECKPOINT_FILE
        return f"{self.ref.artifact_dir}/{name}"

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
                key_id=str(raw.get("key_id") or ""),
                signature=str(raw.get("signature") or ""),
                **_format_fields(raw),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a Relay checkpoint manifest: {exc}") from exc


def _format_fields(raw: dict[str, object]) -> dict[str, object]:
    """Parse ``format`` and ``files`` (absent in manifests older than DCP support)."""
    fmt = str(raw.get("format", FORMAT_TORCH))
    if fmt not in FORMATS:
        raise ValueError(f"field format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    table = raw.get("files") or {}
    if not isinstance(table, dict):
        raise TypeError(f"field files: expected an object, found {type(table).__name__}")
    files = {str(k): str(v) for k, v in table.items()}
    if fmt == FORMAT_DCP:
        if not files:
            raise ValueError("field files: a dcp checkpoint must list its files")
        if files_digest(files) != raw["sha256"]:
            raise ValueError("field sha256: does not match the digest of field files")
    return {"format": fmt, "files": files}
