"""What MLflow shows of a DAG run, against a real MLflow store on disk.

Checkpoints as logged models: one per checkpoint, READY only once checked, linked to its
attempt run, its step and its parent's model; registered by reference; made once however
often the chain is read. The parent run's summary (faults, lost steps, time lost, ETTR);
a faulted attempt run's name; links that open MLflow's model-training view."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from mlflow.entities import LoggedModelStatus

from relay.core.attempt import AttemptState
from relay.core.checkpoint_keys import checkpoint_keys
from relay.lineage.links import experiment_url, experiments_url, ui_of
from relay.lineage.models import MODEL_TYPE, checkpoint_models, record_chain
from relay.lineage.report import FaultRow
from relay.lineage.run_view import RunView
from relay.lineage.store import TAG_FAULT, Lineage
from relay.lineage.summary import summary_metrics
from relay.lineage.tags import (
    TAG_MODEL_CHECKPOINT_URI,
    TAG_MODEL_KEY_ID,
    TAG_MODEL_PARENT,
    TAG_MODEL_PROBLEM,
    TAG_MODEL_SHA256,
)
from relay_train.checkpoints.publish import MlflowCheckpointSink
from relay_train.protocol.manifest import CHECKPOINT_FILE, CheckpointManifest, file_sha256
from relay_train.protocol.signing import KeyRing, sign


def _publish(lineage: Lineage, run_id: str, step: int, parent: CheckpointManifest | None,
             folder: Path, origin: str = "periodic",
             ring: KeyRing | None = None) -> CheckpointManifest:
    path = folder / f"state-{step}" / CHECKPOINT_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(f"weights after step {step}".encode())
    manifest = CheckpointManifest(step=step, sha256=file_sha256(path),
                                  size_bytes=path.stat().st_size, world_size=2, job="t",
                                  run_id=run_id, parent=parent.ref if parent else None,
                                  created_at=time.time(), origin=origin)
    signed = sign(manifest, ring or checkpoint_keys())  # as the ranks sign theirs
    MlflowCheckpointSink(lineage.tracking_uri, run_id).publish(path, signed)
    return signed


Chain = tuple[Lineage, str, list[str], list[CheckpointManifest]]


def _two_attempts(lineage: Lineage, job: str, folder: Path) -> Chain:
    """Try 1 checkpoints step 10, faults; its state at 15 is rescued; try 2 ends at 20."""
    parent = lineage.parent_run(job, f"relay_{job}", "run-1")
    first = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    second = lineage.attempt_run(parent, 0, 2, {"segment": 0})
    c10 = _publish(lineage, first, 10, None, folder / "a")
    c15 = _publish(lineage, first, 15, c10, folder / "b", origin="rescued from rank 1 after hang")
    c20 = _publish(lineage, second, 20, c15, folder / "c")
    return lineage, parent, [first, second], [c20, c15, c10]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lineage, Path]]:
    """One store for the module (making an MLflow database costs seconds); a job each."""
    root = tmp_path_factory.mktemp("models")
    yield Lineage(f"sqlite:///{root / 'mlflow.db'}", root / "artifacts"), root


@pytest.fixture(scope="module")
def chain(store: tuple[Lineage, Path]) -> Chain:
    lineage, root = store
    return _two_attempts(lineage, "t", root / "t")


def _checkpoint_file(lineage: Lineage, manifest: CheckpointManifest) -> Path:
    uri = lineage.client.get_run(manifest.run_id).info.artifact_uri
    return Path(urlparse(uri).path) / manifest.artifact


def test_each_checkpoint_of_the_chain_is_a_ready_model_naming_its_parent(chain: Chain) -> None:
    lineage, parent, (first, second), chain = chain  # type: ignore[assignment]

    ids = record_chain(lineage, parent, chain, checkpoint_keys())

    models = [lineage.client.get_logged_model(i) for i in ids]
    assert [m.name for m in models] == ["step-00000020", "step-00000015-rescued",
                                        "step-00000010"]
    assert {m.status for m in models} == {LoggedModelStatus.READY}
    assert {m.model_type for m in models} == {MODEL_TYPE}
    assert [m.source_run_id for m in models] == [second, first, first]
    assert [m.params["step"] for m in models] == ["20", "15", "10"]
    assert models[1].params["origin"] == "rescued from rank 1 after hang"
    assert [m.tags[TAG_MODEL_PARENT] for m in models] == [ids[1], ids[2], ""]  # to step 0
    for model, manifest in zip(models, chain, strict=True):
        assert model.tags[TAG_MODEL_SHA256] == manifest.sha256
        assert model.tags[TAG_MODEL_KEY_ID] == manifest.key_id != ""
        assert TAG_MODEL_PROBLEM not in model.tags
        # By reference: the model points at the attempt's artifacts and holds no copy.
        uri = model.tags[TAG_MODEL_CHECKPOINT_URI]
        assert uri.endswith(f"/{manifest.artifact}") and manifest.run_id in uri
        assert lineage.client.list_logged_model_artifacts(model.model_id) == []
    outputs = lineage.client.get_run(second).outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs] == [(ids[0], 20)]  # the run lists it


def test_reading_the_chain_again_makes_no_second_model(chain: Chain) -> None:
    lineage, parent, _, chain = chain  # type: ignore[assignment]
    ids = record_chain(lineage, parent, chain, checkpoint_keys())

    again = record_chain(lineage, parent, chain, checkpoint_keys())

    assert again == ids
    experiment = lineage.find_experiment_id("t")
    assert experiment is not None and len(checkpoint_models(lineage, experiment)) == 3


def test_a_damaged_or_forged_checkpoint_is_a_failed_model(store: tuple[Lineage, Path]) -> None:
    lineage, root = store
    _, parent, (_, second), chain = _two_attempts(lineage, "u", root / "u")
    _checkpoint_file(lineage, chain[1]).write_bytes(b"damaged after it was logged")
    forged = _publish(lineage, second, 30, chain[0], root / "u" / "d", ring=KeyRing.generate("x"))

    ids = record_chain(lineage, parent, [forged, *chain], checkpoint_keys())

    models = [lineage.client.get_logged_model(i) for i in ids]
    assert [m.status for m in models] == [LoggedModelStatus.FAILED, LoggedModelStatus.READY,
                                          LoggedModelStatus.FAILED, LoggedModelStatus.READY]
    assert "not among the accepted keys" in models[0].tags[TAG_MODEL_PROBLEM]
    assert "sha256" in models[2].tags[TAG_MODEL_PROBLEM]


def test_a_faulted_attempt_run_is_failed_with_its_fault_in_its_name(
        store: tuple[Lineage, Path]) -> None:
    lineage, _ = store
    parent = lineage.parent_run("v", "relay_v", "run-1")
    run = lineage.attempt_run(parent, 0, 1, {"segment": 0})

    lineage.finish_run(run, AttemptState.RECORDED, {TAG_FAULT: "hang"})
    lineage.finish_run(run, AttemptState.RECORDED, {TAG_FAULT: "hang"})  # a retried record

    info = lineage.client.get_run(run).info
    assert (info.run_name, info.status) == ("segment-000-try-1 (hang)", "FAILED")


def _view(faults: list[FaultRow], lost: dict[str, float]) -> RunView:
    return RunView(job="t", dag_id="relay_t", dag_run_id="r", parent_run_id="p",
                   outcome="completed", total_steps=100, policy_sha256="", started_at=0.0,
                   ended_at=100.0, attempts=[], faults=faults, progress_step=100,
                   goodput={"ettr": 0.8125, "lost_seconds_by_fault": lost}, eta_seconds=0.0)


def test_the_parent_run_summary_counts_faults_by_kind_and_what_they_cost() -> None:
    faults = [FaultRow(0, "hang", "rank 1", 2.0, "retry", 0, 3.5),
              FaultRow(1, "crash", "rank 0", 1.0, "retry", 7, 4.0),
              FaultRow(1, "hang", "rank 1", 2.0, "retry", None, None)]

    metrics, tags = summary_metrics(_view(faults, {"hang": 9.5, "crash": 6.25}))

    assert metrics == {"faults": 3.0, "faults.hang": 2.0, "faults.crash": 1.0,
                       "lost_steps": 7.0, "time_lost_seconds": 15.75, "ettr": 0.8125,
                       "time_lost_seconds.hang": 9.5, "time_lost_seconds.crash": 6.25}
    assert tags == {"relay.faults": "crash:1,hang:2"}
    assert summary_metrics(_view([], {}))[1] == {"relay.faults": "none"}


def test_links_into_mlflow_open_its_model_training_view() -> None:
    assert experiment_url("http://h:5000/", "7", "models") == (
        "http://h:5000/#/experiments/7/models?workflowType=machine_learning")
    assert experiment_url("http://h:5000", "7") == (
        "http://h:5000/#/experiments/7?workflowType=machine_learning")
    assert experiments_url("http://h:5000") == (
        "http://h:5000/#/experiments?workflowType=machine_learning")
    assert ui_of("http://h:5000") == "http://h:5000" and ui_of("sqlite:////x.db") is None
