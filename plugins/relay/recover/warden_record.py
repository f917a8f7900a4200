"""What a warden did to an attempt, kept where ``execute_complete`` on any machine reads it.

The warden (:mod:`relay.recover.warden`) runs on the triggerer's machine and keeps
its record (``unattended/stopped.json``: a :class:`Stopped`), the stacks it
gathered (``evidence-received/``) and the rescued state (``rescued/``) in the
attempt folder there. After its stop (never before: a frozen rank may hold the
tracking store's lock until its process is gone) it logs them to the attempt's
MLflow run under ``unattended/`` (:func:`publish`); ``execute_complete`` that
finds no record on its own disk downloads them into its attempt folder
(:func:`fetch`), where the pipeline reads them as if the warden had run there
(and checks the rescued file's sha256 again).
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay.recover.evidence import RECEIVED_DIR as EVIDENCE_DIR
from relay_train.protocol.heartbeat import write_atomically

FOLDER = "unattended"  # in the attempt folder: the warden, the claim and the lease
WARDEN_FILE = "warden.json"
CLAIM_FILE = "claimed.json"
STOPPED_FILE = "stopped.json"
LOCK_FILE = "lease.lock"

log = logging.getLogger(__name__)


def folder(attempt_dir: Path) -> Path:
    """Return where an attempt's warden, its claim and its lease live."""
    return attempt_dir / FOLDER


@dataclass
class Stopped:
    """What a warden did before ``execute_complete`` ran."""

    by: str
    detected_at: float
    stopped_at: float
    step: str
    survivors: list[str]
    rescued: dict[str, Any] | None = None  # RescueResult fields
    drained_at: int | None = None
    evidence_request: dict[str, Any] | None = None  # {id, ranks}

    @classmethod
    def read(cls, attempt_dir: Path) -> Stopped | None:
        """Return the warden's record, if it finished its work."""
        try:
            raw = json.loads((folder(attempt_dir) / STOPPED_FILE).read_text())
            return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            return None

    def write(self, attempt_dir: Path) -> None:
        """Keep the record in the attempt folder (fsynced: the task reads it next)."""
        write_atomically(folder(attempt_dir) / STOPPED_FILE,
                         json.dumps(asdict(self), default=str), durable=True)


ARTIFACTS = "unattended"  # in the attempt's MLflow run
RESCUED = f"{ARTIFACTS}/rescued"

log = logging.getLogger(__name__)


def publish(lineage: Any, run_id: str, attempt_dir: Path, stopped: Stopped) -> None:  # noqa: ANN401
    """Log the warden's record, evidence and rescued state to the attempt's run (after the
    stop); the record goes last, so a reader that sees it finds the rest."""
    received = attempt_dir / EVIDENCE_DIR
    if received.is_dir() and any(received.iterdir()):
        lineage.client.log_artifacts(run_id, str(received), f"{ARTIFACTS}/{EVIDENCE_DIR}")
    if stopped.rescued and stopped.rescued.get("path"):
        lineage.client.log_artifact(run_id, stopped.rescued["path"], RESCUED)
    lineage.client.log_artifact(run_id, str(folder(attempt_dir) / STOPPED_FILE), ARTIFACTS)


def fetch(lineage: Any, run_id: str, attempt_dir: Path) -> Stopped | None:  # noqa: ANN401
    """Download what a warden published for this attempt into its folder here; return its
    record (None if it published none)."""
    names = {a.path.rsplit("/", 1)[-1] for a in lineage.client.list_artifacts(run_id, ARTIFACTS)}
    if STOPPED_FILE not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        raw = json.loads(Path(lineage.client.download_artifacts(
            run_id, f"{ARTIFACTS}/{STOPPED_FILE}", tmp)).read_text())
    if EVIDENCE_DIR in names:
        attempt_dir.mkdir(parents=True, exist_ok=True)
        got = lineage.client.download_artifacts(run_id, f"{ARTIFACTS}/{EVIDENCE_DIR}",
                                                str(attempt_dir / "from-warden"))
        _move_into(Path(got), attempt_dir / EVIDENCE_DIR)
    rescued = raw.get("rescued")
    if rescued and rescued.get("path"):
        where = folder(attempt_dir) / "rescued"
        where.mkdir(parents=True, exist_ok=True)
        name = Path(rescued["path"]).name
        got = lineage.client.download_artifacts(run_id, f"{RESCUED}/{name}", str(where))
        raw["rescued"] = {**rescued, "path": str(got)}  # its sha256 is checked on use
    folder(attempt_dir).mkdir(parents=True, exist_ok=True)
    write_atomically(folder(attempt_dir) / STOPPED_FILE, json.dumps(raw, default=str))
    log.info("Fetched what the warden of %s saved from MLflow run %s", attempt_dir, run_id)
    return Stopped.read(attempt_dir)


def _move_into(source: Path, target: Path) -> None:
    """Move every file under ``source`` to the same place under ``target``."""
    for path in sorted(source.rglob("*")):
        if path.is_file():
            dest = target / path.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            path.replace(dest)
