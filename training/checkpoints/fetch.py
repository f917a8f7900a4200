"""Ranks fetch their resume checkpoint from MLflow's artifact store themselves.

Relay's task picks the resume point (the newest checkpoint whose manifest and
bytes agree) and names it in the launch file by run id and artifact path. It
does not hand the ranks a path on its own disk: on a cluster the ranks run on
other machines. One rank per node downloads into a node-local cache (the
others wait on a file lock) and every rank checks the sha256 against the
manifest before anything is unpickled.

MLflow is imported only here, and only by attempts that resume.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import shutil
import time
from pathlib import Path

from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.launch import ResumeFrom
from relay_train.protocol.manifest import FORMAT_DCP, file_sha256, tree_mismatches

log = logging.getLogger(__name__)

DONE = ".verified"  # written in a cache entry once its bytes matched the manifest


def fetch_resume(resume: ResumeFrom, tracking_uri: str, cache: Path) -> ResumeFrom:
    """Return ``resume`` pointing at a verified copy in ``cache`` (download it if needed).

    ``resume.artifact`` is the checkpoint's URI in the artifact store (``file:``,
    ``s3:``, ``mlflow-artifacts:`` ...), read straight from the store: no
    tracking-store query on the resume path. ``tracking_uri`` resolves
    ``mlflow-artifacts:`` URIs served by an MLflow server. A resume point
    without one (made by hand, or by an older Relay) is used as it is; the
    loaders still check its sha256.
    """
    if not resume.artifact:
        return resume
    entry = cache / f"step-{resume.step:08d}-{resume.sha256[:16]}"
    entry.mkdir(parents=True, exist_ok=True)
    local = entry / Path(resume.artifact).name
    with (entry / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node; the others wait for it
        if not (entry / DONE).exists():
            _download(resume, tracking_uri, entry, local)
    return dataclasses.replace(resume, path=str(local))


def _download(resume: ResumeFrom, tracking_uri: str, entry: Path, local: Path) -> None:
    from mlflow.artifacts import download_artifacts

    started = time.perf_counter()
    if local.exists():  # a download cut short by a crash
        shutil.rmtree(local) if local.is_dir() else local.unlink()
    where = f"checkpoint {resume.artifact} of MLflow run {resume.run_id} (step {resume.step})"
    try:
        got = download_artifacts(artifact_uri=resume.artifact, dst_path=str(entry),
                                 tracking_uri=tracking_uri)
    except Exception as exc:
        raise RuntimeError(
            f"{where}: could not be downloaded ({type(exc).__name__}: {exc}). Check that "
            f"this node reaches MLflow's artifact store (tracking URI {tracking_uri})."
        ) from exc
    if Path(got) != local:
        raise RuntimeError(f"{where}: expected it at {local}, MLflow wrote {got}")
    problem = _mismatch(resume, local)
    if problem:
        raise CorruptCheckpointError(
            f"{where} does not match its manifest: {problem}. Do not load it: Relay "
            "resumes from the previous checkpoint on its next try.")
    (entry / DONE).write_text(resume.sha256)
    log.info("fetched %s in %.2fs", where, time.perf_counter() - started)


def _mismatch(resume: ResumeFrom, local: Path) -> str:
    """Return what differs between the downloaded copy and the manifest ('' if nothing)."""
    if resume.format == FORMAT_DCP:
        return "; ".join(str(p) for p in tree_mismatches(local, resume.files))
    actual = file_sha256(local)
    return "" if actual == resume.sha256 else f"sha256 {actual}, expected {resume.sha256}"
