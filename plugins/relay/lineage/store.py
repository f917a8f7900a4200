"""MLflow lineage: a run per DAG run, a child run per segment attempt, checkpoints.

Everything goes through an explicit :class:`MlflowClient` with explicit run
ids; get-or-create lookups (by tags) make a retried or re-entered task reuse
the runs it already made instead of forking the lineage.
"""

from __future__ import annotations

import fcntl
import json
import logging
import tempfile
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import RunStatus
from mlflow.store.artifact.artifact_repo import ArtifactRepository
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient
from tenacity import Retrying

from relay.core import settings
from relay.core.attempt import AttemptState
from relay.lineage.tags import (  # noqa: F401 - re-exported: the tags are the store's vocabulary
    MODEL_TRAINING_KIND,
    TAG_DAG_ID,
    TAG_DAG_RUN,
    TAG_EXPERIMENT_KIND,
    TAG_FAILURE_REASON,
    TAG_FAULT,
    TAG_FENCED_AT,
    TAG_FENCED_CHECKPOINTS,
    TAG_FENCED_REASON,
    TAG_JOB,
    TAG_OUTCOME,
    TAG_PARENT,
    TAG_REJECTED,
    TAG_SEGMENT,
    TAG_TRY,
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
from relay_train.publish import mlflow_retrying

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
                          format=m.format, files=dict(m.files), artifact=self.artifact_uri)


@dataclass(frozen=True)
class CorruptCheckpoint:
    """A checkpoint whose file did not match its manifest."""

    manifest: CheckpointManifest
    actual_sha256: str
    detail: str = ""  # DCP: which files differ


class Lineage:
    """Read and write Relay's lineage in one MLflow tracking store."""

    def __init__(
        self, tracking_uri: str, artifact_root: Path, retrying: Retrying | None = None
    ) -> None:
        self.tracking_uri = tracking_uri
        self.artifact_root = artifact_root
        self._retrying = retrying or mlflow_retrying()
        self._client: MlflowClient | None = None
        self._repos: dict[str, ArtifactRepository] = {}

    @classmethod
    def from_settings(cls) -> Lineage:
        """Build from ``RELAY_*`` settings."""
        return cls(settings.mlflow_tracking_uri(), settings.mlflow_artifact_root())

    @property
    def client(self) -> MlflowClient:
        """Return the client, creating the SQLite schema once (racing creators crash)."""
        if self._client is None:
            if self.tracking_uri.startswith("sqlite:///"):
                db = Path(self.tracking_uri.removeprefix("sqlite:///"))
                db.parent.mkdir(parents=True, exist_ok=True)
                with open(db.with_suffix(".lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    client = MlflowClient(tracking_uri=self.tracking_uri)
                    client.search_experiments(max_results=1)  # creates/upgrades the schema
            else:
                client = MlflowClient(tracking_uri=self.tracking_uri)
            self._client = client
        return self._client

    def ensure_store(self) -> None:
        """Create (or upgrade) the tracking store's tables now, not on the first call."""
        self.client.search_experiments(max_results=1)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        return self._retrying(fn, *args, **kwargs)

    def _artifacts(self, run: Any) -> ArtifactRepository:  # noqa: ANN401 - an MLflow run
        """Return the artifact store of a run already read: the client's own list and
        download calls look the run up again (a ``get_run``) on every call, twice per
        checkpoint when reading a chain."""
        repo = self._repos.get(run.info.run_id)
        if repo is None:
            repo = get_artifact_repository(run.info.artifact_uri, tracking_uri=self.tracking_uri)
            self._repos[run.info.run_id] = repo
        return repo

    def experiment_id(self, job: str) -> str:
        """Get or create the experiment of ``job`` (with an explicit artifact location)."""
        name = f"relay/{job}"
        found = self._call(self.client.get_experiment_by_name, name)
        if found is not None:
            return str(found.experiment_id)
        location = None
        if not self.tracking_uri.startswith(("http://", "https://")):
            # Direct stores need an explicit place, or artifacts land in the process's cwd;
            # a server keeps them in its own artifact root.
            (self.artifact_root / job).mkdir(parents=True, exist_ok=True)
            location = (self.artifact_root / job).as_uri()
        try:
            return str(self._call(self.client.create_experiment, name, location,
                                  {TAG_EXPERIMENT_KIND: MODEL_TRAINING_KIND}))
        except Exception:  # another task created it first
            found = self._call(self.client.get_experiment_by_name, name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _find_run(self, experiment_id: str, tags: Mapping[str, str]) -> str | None:
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self._call(
            self.client.search_runs, [experiment_id], filter_string=query, max_results=2
        )
        return runs[0].info.run_id if runs else None

    def parent_run(
        self, job: str, dag_id: str, dag_run_id: str, params: Mapping[str, Any] | None = None
    ) -> str:
        """Get or create the run of one DAG run (``params`` are logged when creating it)."""
        exp = self.experiment_id(job)
        tags = {TAG_JOB: job, TAG_DAG_ID: dag_id, TAG_DAG_RUN: dag_run_id}
        found = self._find_run(exp, {TAG_DAG_RUN: dag_run_id})
        if found:
            return found
        run = self._call(self.client.create_run, exp, tags=tags, run_name=dag_run_id)
        run_id = str(run.info.run_id)
        self._log_params(run_id, params or {})
        log.info("Created MLflow run %s for DAG run %s", run_id, dag_run_id)
        return run_id

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        for k, v in params.items():
            self._call(self.client.log_param, run_id, k, v)

    def attempt_run(
        self, parent_run_id: str, segment: int, try_number: int, params: Mapping[str, Any]
    ) -> str:
        """Create the child run of one segment attempt (one launch of one Airflow try).

        Every launch gets its own run, even a second launch of the same try (a task
        killed before Airflow counted a new try, or `airflow tasks test`); call
        :meth:`abandon_running` first so earlier ones are closed, never merged.
        """
        parent = self._call(self.client.get_run, parent_run_id)
        exp = parent.info.experiment_id
        key = {TAG_PARENT: parent_run_id, TAG_SEGMENT: str(segment), TAG_TRY: str(try_number)}
        tags = {**key, TAG_JOB: parent.data.tags.get(TAG_JOB, ""),
                TAG_OUTCOME: AttemptState.RUNNING.value}
        name = f"segment-{segment:03d}-try-{try_number}"
        run = self._call(self.client.create_run, exp, tags=tags, run_name=name)
        run_id = str(run.info.run_id)
        self._log_params(run_id, params)
        return run_id

    def abandon_running(self, parent_run_id: str, segment: int) -> list[str]:
        """Close the still-``running`` attempt runs of a segment as ``abandoned``."""
        stale = [
            run.info.run_id for run in self.child_runs(parent_run_id)
            if run.data.tags.get(TAG_SEGMENT) == str(segment)
            and AttemptState.from_outcome(run.data.tags.get(TAG_OUTCOME))
            is AttemptState.RUNNING
        ]
        for run_id in stale:
            self.fence_attempt(run_id, "abandoned: its task was killed, a new try replaces it")
            self.finish_run(run_id, AttemptState.ABANDONED)
        return stale

    def finish_run(
        self, run_id: str, state: AttemptState, tags: Mapping[str, str] | None = None
    ) -> None:
        """Tag a run's outcome (``state.outcome``: an attempt's, or a DAG run's) and close it
        (FINISHED when completed, FAILED otherwise)."""
        outcome = state.outcome
        for k, v in {TAG_OUTCOME: outcome.value, **(tags or {})}.items():
            self._call(self.client.set_tag, run_id, k, v)
        ok = outcome is AttemptState.COMPLETED
        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self._call(self.client.set_terminated, run_id, status)

    def fence_attempt(self, run_id: str, reason: str, accept: tuple[str, ...] = ()) -> list[str]:
        """Fence an attempt's run: from now on only its checkpoints published so far count.

        ``accept`` adds step dirs Relay itself publishes for the attempt afterwards (a
        rescued state). Fencing twice keeps the first time and list. Return the accepted.
        """
        tags = self._call(self.client.get_run, run_id).data.tags
        if TAG_FENCED_CHECKPOINTS in tags:
            accepted = [d for d in tags[TAG_FENCED_CHECKPOINTS].split(",") if d]
        else:
            accepted = self._published_dirs(run_id)
            self._call(self.client.set_tag, run_id, TAG_FENCED_AT, f"{time.time():.3f}")
            self._call(self.client.set_tag, run_id, TAG_FENCED_REASON, reason[:4000])
        accepted = sorted(set(accepted) | set(accept))
        self._call(self.client.set_tag, run_id, TAG_FENCED_CHECKPOINTS, ",".join(accepted))
        log.info("Fenced attempt run %s (%s): checkpoints %s count, any later one is refused",
                 run_id, reason, accepted or "none")
        return accepted

    def _published_dirs(self, run_id: str) -> list[str]:
        """Return the step dirs of a run whose manifest is logged (the ones that count)."""
        dirs = []
        for entry in self._call(self.client.list_artifacts, run_id, CHECKPOINT_ROOT):
            names = {a.path.rsplit("/", 1)[-1]
                     for a in self._call(self.client.list_artifacts, run_id, entry.path)}
            if entry.is_dir and MANIFEST_FILE in names:
                dirs.append(entry.path.rsplit("/", 1)[-1])
        return dirs

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

    def log_json(self, run_id: str, artifact_file: str, payload: Any) -> None:  # noqa: ANN401
        """Log ``payload`` as a JSON artifact."""
        self._call(self.client.log_text, run_id, json.dumps(payload, indent=2), artifact_file)

    def log_folder(self, run_id: str, folder: Path, artifact_path: str) -> None:
        """Log every file under ``folder`` as artifacts under ``artifact_path``."""
        self._call(self.client.log_artifacts, run_id, str(folder), artifact_path)

    def child_runs(self, parent_run_id: str) -> list[Any]:
        """Return the segment-attempt runs of a DAG run, oldest first."""
        parent = self._call(self.client.get_run, parent_run_id)
        runs = self._call(
            self.client.search_runs,
            [parent.info.experiment_id],
            filter_string=f"tags.`{TAG_PARENT}` = '{parent_run_id}'",
            max_results=10_000,
            order_by=["attributes.start_time ASC"],
        )
        return list(runs)

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
        self, parent_run_id: str, download_dir: Path
    ) -> VerifiedCheckpoint | None:
        """Download the newest checkpoint whose sha256 matches; skip corrupt ones."""
        return self.resume_point(parent_run_id, download_dir)[0]

    def resume_point(
        self, parent_run_id: str, download_dir: Path
    ) -> tuple[VerifiedCheckpoint | None, list[CorruptCheckpoint]]:
        """Return the newest verified checkpoint and the corrupt ones newer than it."""
        corrupt: list[CorruptCheckpoint] = []
        for manifest in self.newest_first(parent_run_id):
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

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Set several tags on a run."""
        for k, v in tags.items():
            self._call(self.client.set_tag, run_id, k, v)

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
