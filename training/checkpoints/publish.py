"""Publish checkpoints and metrics to an MLflow run, retrying at the I/O edge.

A checkpoint must reach MLflow (its manifest is what makes it count), so its
failure is raised. Metrics are only a view: a write that still fails after a
short bounded retry is dropped, logged once (then counted), and never fails the
checkpoint queue, the rank or the job.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

from mlflow.entities import Metric
from mlflow.store.db.db_types import DATABASE_ENGINES  # the schemes of MLflow's database store
from mlflow.tracking import MlflowClient
from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from relay_train.protocol.manifest import (
    DCP_DIR,
    FORMAT_DCP,
    MANIFEST_FILE,
    CheckpointManifest,
    step_dir,
)

log = logging.getLogger(__name__)


def preload_store(tracking_uri: str | None) -> None:
    """Import the MLflow tracking store that ``tracking_uri`` opens, before any rank does.

    Opening a database store imports SQLAlchemy and MLflow's table models, about 370
    modules and half a second of CPU on these machines; rank 0 otherwise does it
    beside its first steps, holding the GIL its training loop needs. ``None``: the
    URI is not known yet (a standby preloads before its launch), so the database
    store is imported, off the critical path either way.
    """
    scheme = urlparse(tracking_uri).scheme.partition("+")[0] if tracking_uri else None
    if scheme is None or scheme in DATABASE_ENGINES:
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - the import is the point


def mlflow_retrying(attempts: int = 5, max_wait_seconds: float = 8.0) -> Retrying:
    """Return the retry policy for MLflow calls made from a worker."""
    return Retrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.25, max=max_wait_seconds),
        retry=retry_if_exception_type(Exception),
        before_sleep=before_sleep_log(log, logging.WARNING),
        reraise=True,
    )


def metrics_retrying(attempts: int = 3, max_wait_seconds: float = 2.0) -> Retrying:
    """Return the short, quiet retry for writes that may be dropped (metrics)."""
    return Retrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.25, max=max_wait_seconds),
        retry=retry_if_exception_type(Exception),
        reraise=True,
    )


class MlflowCheckpointSink:
    """Log checkpoint files, then manifests, as artifacts of one MLflow run."""

    def __init__(self, tracking_uri: str, run_id: str, retrying: Retrying | None = None,
                 optional_retrying: Retrying | None = None) -> None:
        self.run_id = run_id
        self._tracking_uri = tracking_uri
        self._client_instance: MlflowClient | None = None
        self._retrying = retrying or mlflow_retrying()
        self._optional = optional_retrying or metrics_retrying()
        self.dropped = 0  # metric batches given up on

    @property
    def _client(self) -> MlflowClient:
        # Made on first use, which is the checkpointer's background thread: the training
        # loop must not wait for a tracking server before its first step (under Relay's
        # node agent, the store's modules are imported before the ranks start: preload_store).
        if self._client_instance is None:
            self._client_instance = MlflowClient(tracking_uri=self._tracking_uri)
        return self._client_instance

    def connect(self) -> None:
        """Open the tracking store now (off the loop's thread); a failure waits for the
        first checkpoint, which retries on its own."""
        try:
            self._optional(lambda: self._client.get_run(self.run_id))
        except Exception as exc:  # noqa: BLE001 - a warm-up, not a write
            log.warning("MLflow run %s not reachable yet (%s); the first checkpoint will retry",
                        self.run_id, exc)

    def publish(self, checkpoint: Path, manifest: CheckpointManifest) -> None:
        """Log the checkpoint file, then (only then) the manifest that makes it count.

        A DCP checkpoint is a folder: all its files go under ``DCP_DIR`` first.
        """
        folder = step_dir(manifest.step)
        if manifest.format == FORMAT_DCP:
            self._retrying(self._client.log_artifacts, self.run_id, str(checkpoint),
                           f"{folder}/{DCP_DIR}")
        else:
            self._retrying(self._client.log_artifact, self.run_id, str(checkpoint), folder)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / MANIFEST_FILE
            path.write_text(manifest.to_json())
            self._retrying(self._client.log_artifact, self.run_id, str(path), folder)

    def log_metrics(self, batch: Sequence[tuple[int, Mapping[str, float], int]]) -> None:
        """Log the metrics of several steps, each (step, values, timestamp in ms), in one
        request: one a step made rank 0's publisher thread hold the GIL its training loop
        needs for ~30% of each step on a loaded host (``relay.tools.bench.cpu_wait_probe``)."""
        metrics = [Metric(k, float(v), timestamp_ms, step)
                   for step, values, timestamp_ms in batch for k, v in values.items()]
        if not metrics:
            return
        try:
            self._optional(self._client.log_batch, self.run_id, metrics=metrics)
        except Exception as exc:  # noqa: BLE001 - metrics are dropped, never fatal
            self.dropped += 1
            if self.dropped == 1:
                log.warning("Dropped metrics of steps %d-%d: MLflow run %s refused them after "
                            "retries (%s); later drops are only counted", batch[0][0],
                            batch[-1][0], self.run_id, exc)
