"""MLflow's own UI, in headless Chromium, against a real MLflow server: a fresh browser
following Relay's link lands on the model-training view of a Relay experiment, and its
Models tab lists the checkpoint chain (`make test-slow`: an MLflow server and Chromium,
about a minute)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from browser import Chromium, ensure_chromium

from relay.core.attempt import AttemptState
from relay.core.checkpoint_keys import checkpoint_keys
from relay.lineage.links import experiment_url
from relay.lineage.models import record_chain
from relay.lineage.store import TAG_FAULT, Lineage
from relay.tools.mlflow_server import mlflow_server
from relay_train.checkpoints.publish import MlflowCheckpointSink
from relay_train.protocol.manifest import CHECKPOINT_FILE, CheckpointManifest, file_sha256
from relay_train.protocol.signing import sign

pytestmark = pytest.mark.slow
GENAI_ONLY = ("Evaluation runs", "Judges", "Agent versions")  # the GenAI view's sidebar


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


def _publish(lineage: Lineage, run_id: str, step: int, parent: CheckpointManifest | None,
             folder: Path) -> CheckpointManifest:
    path = folder / f"state-{step}" / CHECKPOINT_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(f"weights after step {step}".encode())
    manifest = sign(CheckpointManifest(
        step=step, sha256=file_sha256(path), size_bytes=path.stat().st_size, world_size=2,
        job="ui", run_id=run_id, parent=parent.ref if parent else None,
        created_at=time.time()), checkpoint_keys())
    MlflowCheckpointSink(lineage.tracking_uri, run_id).publish(path, manifest)
    return manifest


def _recorded_run(lineage: Lineage, folder: Path) -> tuple[str, str]:
    """A DAG run as Relay leaves it: a faulted try, a retry, the chain as models."""
    parent = lineage.parent_run("ui", "relay_ui", "run-1")
    first = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    c10 = _publish(lineage, first, 10, None, folder / "a")
    lineage.finish_run(first, AttemptState.RECORDED, {TAG_FAULT: "hang"})
    second = lineage.attempt_run(parent, 0, 2, {"segment": 0})
    c20 = _publish(lineage, second, 20, c10, folder / "b")
    lineage.finish_run(second, AttemptState.COMPLETED)
    record_chain(lineage, parent, [c20, c10], checkpoint_keys())
    lineage.finish_run(parent, AttemptState.COMPLETED)
    experiment = lineage.find_experiment_id("ui")
    assert experiment is not None
    return experiment, parent


def _fresh_page(url: str, until: Callable[[str], bool]) -> tuple[str, str]:
    """Open ``url`` in a fresh Chromium (empty profile); return its text once ``until`` holds
    (or after two minutes) and where it landed."""
    ensure_chromium()
    browser = Chromium()
    try:
        browser.open(url, settle=0.5)
        return browser.wait_for_text(until), str(browser.evaluate("location.href"))
    finally:
        browser.close()


def test_a_fresh_browser_lands_on_the_training_view_and_the_models_tab_lists_the_chain(
        mlflow: str, tmp_path: Path) -> None:
    lineage = Lineage(mlflow, tmp_path / "unused")
    experiment, _ = _recorded_run(lineage, tmp_path)

    text, landed = _fresh_page(experiment_url(mlflow, experiment),
                               lambda t: "run-1" in t)
    assert "/runs" in landed and "workflowType=machine_learning" in landed, landed
    assert "run-1" in text and "Models" in text, text  # the DAG run's run, the Models tab
    assert not [w for w in GENAI_ONLY if w in text], text

    text, _ = _fresh_page(experiment_url(mlflow, experiment, "models"),
                          lambda t: "step-00000020" in t and "step-00000010" in t)
    assert "step-00000020" in text and "step-00000010" in text, text
    assert not [w for w in GENAI_ONLY if w in text], text


def test_without_relay_link_mlflow_opens_a_relay_experiment_in_its_genai_view(
        mlflow: str, tmp_path: Path) -> None:
    """Why Relay's links carry workflowType: MLflow 3.17 ignores mlflow.experimentKind here
    (if this fails, MLflow reads the tag again and the link's parameter is only a belt)."""
    lineage = Lineage(mlflow, tmp_path / "unused")
    experiment = lineage.experiment_id("ui")

    text, _ = _fresh_page(f"{mlflow}/#/experiments/{experiment}",
                          lambda t: all(w in t for w in GENAI_ONLY))
    assert all(w in text for w in GENAI_ONLY), text
