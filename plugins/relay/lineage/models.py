"""Checkpoints as MLflow 3 logged models, so the experiment's Models tab lists the chain.

Relay makes them, never a rank: once per checkpoint (per attempt run and step dir), when
it reads a finished DAG run's chain (``FinalizeOperator``), after checking each one, the
periodic and the rescued alike. A model's status says what the check found: READY (its
manifest's signature holds and its bytes match the manifest), FAILED (either did not).
A model holds no copy of the weights: ``relay.checkpoint_uri`` names the checkpoint's
artifacts in its attempt run (registered by reference, never uploaded twice). Each model
names its parent checkpoint's model (``relay.parent_model_id``), so the final model's
lineage back to step 0 is browsable in MLflow itself.
"""

from __future__ import annotations

import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow.entities import LoggedModelOutput, LoggedModelStatus

from relay.lineage.checkpoints import READERS
from relay.lineage.store import TAG_SEGMENT, TAG_TRY, Lineage
from relay.lineage.tags import (
    TAG_MODEL_CHECKPOINT,
    TAG_MODEL_CHECKPOINT_URI,
    TAG_MODEL_KEY_ID,
    TAG_MODEL_PARENT,
    TAG_MODEL_PROBLEM,
    TAG_MODEL_SHA256,
)
from relay_train.protocol.manifest import CheckpointManifest
from relay_train.protocol.signing import KeyRing, signature_problem

log = logging.getLogger(__name__)
MODEL_TYPE = "relay-checkpoint"


def checkpoint_key(manifest: CheckpointManifest) -> str:
    """Return the one name of a checkpoint across MLflow: ``<attempt run id>/step-NNNNNNNN``."""
    return f"{manifest.run_id}/{manifest.ref.artifact_dir.rsplit('/', 1)[-1]}"


def model_name(manifest: CheckpointManifest) -> str:
    """Return the model's name as the Models tab lists it: its step, and rescued or not."""
    rescued = "" if manifest.origin == "periodic" else "-rescued"
    return f"step-{manifest.step:08d}{rescued}"


def checkpoint_models(lineage: Lineage, experiment_id: str) -> dict[str, Any]:
    """Return the experiment's checkpoint models by checkpoint key."""
    found: dict[str, Any] = {}
    token = None
    while True:
        page = lineage._call(lineage.client.search_logged_models, [experiment_id],
                             filter_string=f"model_type = '{MODEL_TYPE}'", max_results=100,
                             page_token=token)
        for model in page:
            key = model.tags.get(TAG_MODEL_CHECKPOINT)
            if key:
                found[key] = model
        token = page.token
        if not token:
            return found


def _check(lineage: Lineage, manifest: CheckpointManifest, ring: KeyRing) -> str | None:
    """Return why a checkpoint does not hold (its signature, then its bytes), or None."""
    problem = signature_problem(manifest, ring)
    if problem is not None:
        return problem
    with tempfile.TemporaryDirectory() as tmp:
        _, bad = lineage._download_verified(manifest, Path(tmp))
    return None if bad is None else bad.describe()


def record_chain(lineage: Lineage, parent_run_id: str, chain: list[CheckpointManifest],
                 ring: KeyRing) -> list[str]:
    """Make a logged model for every checkpoint of ``chain`` (newest first) that has none
    READY yet, after checking it; return the model ids, newest first."""
    if not chain:
        return []
    experiment = lineage._call(lineage.client.get_run, parent_run_id).info.experiment_id
    existing = checkpoint_models(lineage, experiment)
    todo = [m for m in chain if getattr(existing.get(checkpoint_key(m)), "status", None)
            != LoggedModelStatus.READY]
    with ThreadPoolExecutor(READERS) as pool:
        problems = dict(zip([checkpoint_key(m) for m in todo],
                            pool.map(lambda m: _check(lineage, m, ring), todo), strict=True))
    attempts = {run.info.run_id: run.data.tags for run in lineage.child_runs(parent_run_id)}
    ids: list[str] = []
    parent_id = ""
    for manifest in reversed(chain):  # oldest first: each names its parent's model
        key = checkpoint_key(manifest)
        model = existing.get(key)
        if key in problems:
            model = _record(lineage, experiment, manifest, model, parent_id, problems[key],
                            attempts.get(manifest.run_id, {}))
        parent_id = model.model_id
        ids.append(model.model_id)
    ready = sum(1 for k, p in problems.items() if p is None)
    log.info("Checkpoint models of run %s: %d checked now (%d READY), %d already READY",
             parent_run_id, len(problems), ready, len(chain) - len(problems))
    return ids[::-1]


def _record(lineage: Lineage, experiment: str, manifest: CheckpointManifest, model: Any,  # noqa: ANN401
            parent_id: str, problem: str | None, attempt: dict[str, str]) -> Any:  # noqa: ANN401
    """Create (or finish) one checkpoint's model with the outcome of its check."""
    run = lineage._call(lineage.client.get_run, manifest.run_id)
    tags = {
        TAG_MODEL_CHECKPOINT: checkpoint_key(manifest),
        TAG_MODEL_CHECKPOINT_URI: f"{run.info.artifact_uri}/{manifest.artifact}",
        TAG_MODEL_SHA256: manifest.sha256, TAG_MODEL_KEY_ID: manifest.key_id,
        TAG_MODEL_PARENT: parent_id, TAG_SEGMENT: attempt.get(TAG_SEGMENT, ""),
        TAG_TRY: attempt.get(TAG_TRY, ""),
    }
    if problem is not None:
        tags[TAG_MODEL_PROBLEM] = problem[:4000]
    if model is None:
        params = {"step": str(manifest.step), "origin": manifest.origin,
                  "format": manifest.format, "world_size": str(manifest.world_size),
                  "size_bytes": str(manifest.size_bytes)}
        model = lineage._call(lineage.client.create_logged_model, experiment,
                              name=model_name(manifest), source_run_id=manifest.run_id,
                              tags=tags, params=params, model_type=MODEL_TYPE)
        lineage._call(lineage.client.log_outputs, manifest.run_id,
                      [LoggedModelOutput(model.model_id, manifest.step)])
    else:
        lineage._call(lineage.client.set_logged_model_tags, model.model_id, tags)
    status = LoggedModelStatus.FAILED if problem else LoggedModelStatus.READY
    if problem:
        log.error("Checkpoint %s does not hold: %s; its model %s is FAILED", manifest.ref,
                  problem, model.model_id)
    return lineage._call(lineage.client.finalize_logged_model, model.model_id, status)
