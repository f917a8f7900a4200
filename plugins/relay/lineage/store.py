"""MLflow lineage: a run per DAG run, a child run per segment attempt, checkpoints
(read back by :mod:`relay.lineage.checkpoints`).

Everything goes through an explicit :class:`MlflowClient` with explicit run
ids; get-or-create lookups (by tags) make a retried or re-entered task reuse
the runs it already made instead of forking the lineage.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, RunStatus
from mlflow.store.artifact.artifact_repo import ArtifactRepository
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient
from tenacity import Retrying

from relay.core import settings
from relay.core.attempt import AttemptState
from relay.lineage.checkpoints import CheckpointReading
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
from relay_train.checkpoints.publish import mlflow_retrying
from relay_train.protocol.manifest import (
    CHECKPOINT_ROOT,
    MANIFEST_FILE,
)

# MLflow draws a tqdm bar on stderr for every artifact download, which a task log shows as
# ERROR lines ("Downloading artifacts: 0%|"); Relay logs what it fetched itself.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

log = logging.getLogger(__name__)



class Lineage(CheckpointReading):
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

    def find_experiment_id(self, job: str) -> str | None:
        """Return the experiment of ``job``, or None if there is none (never creates it:
        readers such as the Recovery page must not write)."""
        found = self._call(self.client.get_experiment_by_name, f"relay/{job}")
        return None if found is None else str(found.experiment_id)

    def experiment_id(self, job: str) -> str:
        """Get or create the experiment of ``job`` (with an explicit artifact location)."""
        name = f"relay/{job}"
        found = self.find_experiment_id(job)
        if found is not None:
            return found
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
        (FINISHED when completed, FAILED otherwise). A run that ended in a fault gets its
        kind in its name ("segment-000-try-1 (hang)"), so MLflow's runs table shows it."""
        outcome = state.outcome
        tags = {TAG_OUTCOME: outcome.value, **(tags or {})}
        for k, v in tags.items():
            self._call(self.client.set_tag, run_id, k, v)
        ok = outcome is AttemptState.COMPLETED
        kind = tags.get(TAG_FAULT)
        if kind and not ok:
            name = self._call(self.client.get_run, run_id).info.run_name or ""
            if not name.endswith(f"({kind})"):
                self._call(self.client.update_run, run_id, name=f"{name} ({kind})".strip())
        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self._call(self.client.set_terminated, run_id, status)

    def fence_attempt(self, run_id: str, reason: str, accept: tuple[str, ...] = ()) -> list[str]:
        """Fence an attempt's run: from now on only its checkpoints published so far count.

        ``accept`` adds step dirs Relay itself publishes for the attempt afterwards (a
        rescued state). Fencing twice keeps the first time and list. Return the accepted.
        """
        tags = self._call(self.client.get_run, run_id).data.tags
        again = TAG_FENCED_CHECKPOINTS in tags
        if again:
            accepted = [d for d in tags[TAG_FENCED_CHECKPOINTS].split(",") if d]
        else:
            accepted = self._published_dirs(run_id)
            self._call(self.client.set_tag, run_id, TAG_FENCED_AT, f"{time.time():.3f}")
            self._call(self.client.set_tag, run_id, TAG_FENCED_REASON, reason[:4000])
        added = sorted(set(accept) - set(accepted))
        accepted = sorted(set(accepted) | set(accept))
        self._call(self.client.set_tag, run_id, TAG_FENCED_CHECKPOINTS, ",".join(accepted))
        if not again:
            log.info("Fenced attempt run %s (%s): checkpoints %s count, any later one is "
                     "refused", run_id, reason, accepted or "none")
        elif added:  # said once per fence: only what this call adds
            log.info("Fenced attempt run %s also accepts %s (published by Relay)", run_id, added)
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

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        """Log several metrics on a run at once (at ``step``)."""
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._call(self.client.log_batch, run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Set several tags on a run."""
        for k, v in tags.items():
            self._call(self.client.set_tag, run_id, k, v)
