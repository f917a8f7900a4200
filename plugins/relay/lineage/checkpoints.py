"""Checkpoints read back from MLflow: every manifest of a DAG run, the chain to step 0, and
the latest one whose signature holds and whose files still match (the resume point),
fenced ones refused. A manifest's signature is checked before any of its files is
downloaded: an unsigned or forged checkpoint is corrupt, and never reaches a rank."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.store.artifact.artifact_repo import ArtifactRepository

from relay.core.checkpoint_keys import checkpoint_keys
from relay.lineage.tags import (
    TAG_FENCED_AT,
    TAG_FENCED_CHECKPOINTS,
    TAG_FENCED_REASON,
    TAG_REJECTED,
)
from relay_train.protocol.launch import ResumeFrom
from relay_train.protocol.manifest import (
    CHECKPOINT_ROOT,
    FORMAT_DCP,
    MANIFEST_FILE,
    CheckpointManifest,
    file_sha256,
    files_digest,
    tree_mismatches,
    tree_sha256s,
)
from relay_train.protocol.signing import KeyRing, signature_problem

log = logging.getLogger(__name__)

READERS = 8  # manifests read at once when a whole chain is read


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose file (or every file of its DCP folder) matched, on local disk."""

    manifest: CheckpointManifest
    path: Path
    artifact_uri: str = ""  # where the ranks fetch it from (the artifact store, not MLflow's API)

    def resume_from(self) -> ResumeFrom:
        """Return the resume point a segment attempt's workers load."""
        m = self.manifest
        return ResumeFrom(path=str(self.path), sha256=m.sha256, run_id=m.run_id, step=m.step,
                          format=m.format, files=dict(m.files), artifact=self.artifact_uri,
                          manifest=m.to_json())


@dataclass(frozen=True)
class CorruptCheckpoint:
    """A checkpoint whose signature did not hold, or whose file did not match its manifest."""

    manifest: CheckpointManifest
    actual_sha256: str  # "" when the signature failed: its files were never downloaded
    detail: str = ""  # DCP: which files differ; a bad signature: why

    @property
    def forged(self) -> bool:
        """Return whether the manifest itself was refused (unsigned or a bad signature)."""
        return not self.actual_sha256

    def describe(self) -> str:
        """Return what is wrong with it, in one line."""
        m = self.manifest
        if self.forged:
            return f"checkpoint at step {m.step} has no valid signature: {self.detail}"
        return (f"checkpoint at step {m.step} has sha256 {self.actual_sha256[:12]}, its manifest "
                f"says {m.sha256[:12]}" + (f" ({self.detail})" if self.detail else ""))


class CheckpointReading:
    """The checkpoint half of :class:`relay.lineage.store.Lineage`, which provides the
    client (``client``, ``_call``, ``_artifacts``) and the DAG run's attempt runs
    (``child_runs``)."""

    client: Any

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        raise NotImplementedError

    def _artifacts(self, run: Any) -> ArtifactRepository:  # noqa: ANN401 - an MLflow run
        raise NotImplementedError

    def child_runs(self, parent_run_id: str) -> list[Any]:
        """Return the segment-attempt runs of a DAG run, oldest first."""
        raise NotImplementedError

    def _refuse_fenced(self, run: Any, step_dir: str) -> bool:  # noqa: ANN401 - an MLflow run
        """Return whether a checkpoint was published after its attempt was fenced; record it."""
        tags = run.data.tags
        if TAG_FENCED_CHECKPOINTS not in tags:
            return False
        if step_dir in tags[TAG_FENCED_CHECKPOINTS].split(","):
            return False
        reason = (f"fenced: published by attempt run {run.info.run_id} after Relay stopped or "
                  f"replaced it at {tags.get(TAG_FENCED_AT)} ({tags.get(TAG_FENCED_REASON)})")
        log.warning("Refused checkpoint %s of run %s: %s", step_dir, run.info.run_id, reason)
        self._call(self.client.set_tag, run.info.run_id, TAG_REJECTED + step_dir, reason)
        return True

    def manifests(self, parent_run_id: str) -> list[CheckpointManifest]:
        """Return every logged checkpoint manifest of a DAG run, newest step first. Each
        costs two round trips (a listing, a download): ``READERS`` at a time, a tracking
        server answers a whole chain in a fraction of the time one by one (finalize reads
        it on the way to the run's end)."""
        dirs = [d for found in self._step_dirs(parent_run_id).values() for d in found]
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(READERS) as pool:
            def read(index: int) -> CheckpointManifest | None:
                into = Path(tmp, str(index))  # its own folder: two attempts may share a step
                into.mkdir()
                return self._manifest(*dirs[index], str(into))

            found = [m for m in pool.map(read, range(len(dirs))) if m is not None]
        return sorted(found, key=lambda m: (m.step, m.created_at), reverse=True)

    def newest_first(self, parent_run_id: str) -> Iterator[CheckpointManifest]:
        """Yield a DAG run's checkpoint manifests, newest step first, reading each only when
        asked for: choosing where to resume reads the newest one or two, not every
        checkpoint the job ever made (a full scan took seconds late in a long job)."""
        by_step = self._step_dirs(parent_run_id)
        with tempfile.TemporaryDirectory() as tmp:
            for step in sorted(by_step, reverse=True):
                found = [m for run, path in by_step[step]
                         if (m := self._manifest(run, path, tmp)) is not None]
                yield from sorted(found, key=lambda m: (m.step, m.created_at), reverse=True)

    def _step_dirs(self, parent_run_id: str) -> dict[int, list[tuple[Any, str]]]:
        """Return each step's checkpoint folders (attempt run, artifact path), rejected not."""
        by_step: dict[int, list[tuple[Any, str]]] = {}
        for run in self.child_runs(parent_run_id):
            rejected = {k.removeprefix(TAG_REJECTED) for k in run.data.tags
                        if k.startswith(TAG_REJECTED)}
            for entry in self._call(self._artifacts(run).list_artifacts, CHECKPOINT_ROOT):
                name = entry.path.rsplit("/", 1)[-1]
                if entry.is_dir and name not in rejected:
                    by_step.setdefault(_step_of(name), []).append((run, entry.path))
        return by_step

    def has_checkpoint(self, parent_run_id: str, step: int) -> bool:
        """Return whether a DAG run has a counted checkpoint at ``step`` (reading newest
        first, down to that step only)."""
        for manifest in self.newest_first(parent_run_id):
            if manifest.step <= step:
                return manifest.step == step
        return False

    def _manifest(self, run: Any, path: str, tmp: str) -> CheckpointManifest | None:  # noqa: ANN401
        """Read one step dir's manifest; None if it is fenced, missing or unreadable."""
        run_id = run.info.run_id
        if self._refuse_fenced(run, path.rsplit("/", 1)[-1]):
            return None
        repo = self._artifacts(run)
        names = {a.path.rsplit("/", 1)[-1] for a in self._call(repo.list_artifacts, path)}
        if MANIFEST_FILE not in names:
            return None  # file logged, manifest not: it does not count
        local = self._call(repo.download_artifacts, f"{path}/{MANIFEST_FILE}", tmp)
        try:
            return CheckpointManifest.from_json(Path(local).read_text())
        except ValueError as exc:
            log.warning("Ignoring bad manifest %s in run %s: %s", path, run_id, exc)
            return None

    def latest_valid_checkpoint(
        self, parent_run_id: str, download_dir: Path, keys: KeyRing | None = None
    ) -> VerifiedCheckpoint | None:
        """Download the newest checkpoint whose signature and sha256 hold; skip corrupt ones."""
        return self.resume_point(parent_run_id, download_dir, keys)[0]

    def resume_point(
        self, parent_run_id: str, download_dir: Path, keys: KeyRing | None = None
    ) -> tuple[VerifiedCheckpoint | None, list[CorruptCheckpoint]]:
        """Return the newest verified checkpoint and the corrupt ones newer than it.

        Verified: its manifest's signature holds under ``keys`` (default: the deployment's
        ring), then its files match the manifest.
        """
        ring = keys or checkpoint_keys()
        corrupt: list[CorruptCheckpoint] = []
        for manifest in self.newest_first(parent_run_id):
            problem = signature_problem(manifest, ring)
            if problem is not None:
                log.error("Refused checkpoint %s: %s; trying the previous one", manifest.ref,
                          problem)
                corrupt.append(CorruptCheckpoint(manifest, "", problem))
                continue
            target = download_dir / f"step-{manifest.step:08d}"
            target.mkdir(parents=True, exist_ok=True)
            local, bad = self._download_verified(manifest, target)
            if bad is None:
                uri = self._call(self.client.get_run, manifest.run_id).info.artifact_uri
                return VerifiedCheckpoint(manifest=manifest, path=local,
                                          artifact_uri=f"{uri}/{manifest.artifact}"), corrupt
            log.error(
                "Corrupt checkpoint %s: expected sha256 %s, found %s%s; trying the previous one",
                manifest.ref, manifest.sha256, bad.actual_sha256,
                f" ({bad.detail})" if bad.detail else "",
            )
            corrupt.append(bad)
        return None, corrupt

    def _download_verified(
        self, manifest: CheckpointManifest, target: Path
    ) -> tuple[Path, CorruptCheckpoint | None]:
        """Download one checkpoint (file or DCP folder) and check it against its manifest."""
        local = Path(self._call(self.client.download_artifacts, manifest.run_id,
                                manifest.artifact, str(target)))
        if manifest.format != FORMAT_DCP:
            actual = file_sha256(local)
            return local, None if actual == manifest.sha256 else CorruptCheckpoint(manifest, actual)
        problems = tree_mismatches(local, manifest.files)
        if not problems:
            return local, None
        actual = files_digest(tree_sha256s(local))
        return local, CorruptCheckpoint(manifest, actual, "; ".join(map(str, problems)))

    def reject_checkpoint(self, manifest: CheckpointManifest, reason: str) -> None:
        """Keep a checkpoint from ever being resumed from again (a rollback)."""
        key = TAG_REJECTED + manifest.ref.artifact_dir.rsplit("/", 1)[-1]
        self._call(self.client.set_tag, manifest.run_id, key, reason[:4000])

    def chain(self, parent_run_id: str) -> list[CheckpointManifest]:
        """Return the checkpoint chain from the newest checkpoint back to the first."""
        manifests = self.manifests(parent_run_id)
        if not manifests:
            return []
        by_ref = {(m.run_id, m.step): m for m in manifests}
        chain = [manifests[0]]
        while (parent := chain[-1].parent) is not None:
            nxt = by_ref.get((parent.run_id, parent.step))
            if nxt is None:
                break
            chain.append(nxt)
        return chain


def _step_of(step_dir: str) -> int:
    """Return the step a checkpoint dir is named for (``step-00000872``); -1 if none."""
    number = step_dir.removeprefix("step-")
    return int(number) if number.isdigit() else -1
