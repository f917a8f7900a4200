"""A DAG run that ends badly closes its MLflow parent run as FAILED, with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from mlflow.entities import RunStatus

from relay.core.settings import REPO_ROOT
from relay.lineage.store import TAG_FAILURE_REASON, Lineage
from relay.lineage.tags import TAG_FAILED_TASK
from relay.nodes.pool import NodePool
from relay.operators.callbacks import CloseParentRunOnFailure
from relay.spec.job import load_job_spec


@pytest.fixture(scope="module")
def lineage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lineage]:
    root = tmp_path_factory.mktemp("callbacks")
    patch = pytest.MonkeyPatch()
    patch.setenv("RELAY_MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    patch.setenv("RELAY_MLFLOW_ARTIFACT_ROOT", str(root / "artifacts"))
    yield Lineage.from_settings()
    patch.undo()


def status(lineage: Lineage, run_id: str) -> str:
    return lineage.client.get_run(run_id).info.status


def test_a_failed_task_closes_the_parent_run_with_its_exception(lineage: Lineage) -> None:
    parent = lineage.parent_run("cb", "relay_cb", "manual__1")
    close = CloseParentRunOnFailure("cb")
    close({"dag_run": SimpleNamespace(run_id="manual__1"), "ti": SimpleNamespace(
        task_id="segment_001"), "exception": AirflowFailException("Segment 1: escalate")})
    run = lineage.client.get_run(parent)
    assert run.info.status == RunStatus.to_string(RunStatus.FAILED)
    assert run.data.tags[TAG_FAILURE_REASON] == "AirflowFailException: Segment 1: escalate"
    assert run.data.tags[TAG_FAILED_TASK] == "segment_001"
    assert run.data.tags["relay.outcome"] == "failed"
    assert run.data.tags["relay.faults"] == "none"  # its summary: no fault was recorded
    assert run.data.metrics["faults"] == 0.0
    # The DAG-level callback after it changes nothing (the run is already closed).
    close({"dag_run": SimpleNamespace(run_id="manual__1"), "reason": "task_failure"})
    assert lineage.client.get_run(parent).data.tags[TAG_FAILED_TASK] == "segment_001"


def test_the_dag_level_callback_closes_what_no_task_reported(lineage: Lineage) -> None:
    parent = lineage.parent_run("cb", "relay_cb", "manual__2")
    CloseParentRunOnFailure("cb")({"dag_run": SimpleNamespace(run_id="manual__2"),
                                   "reason": "task_failure"})
    assert status(lineage, parent) == "FAILED"
    assert lineage.client.get_run(parent).data.tags[TAG_FAILURE_REASON] == "task_failure"


def test_nothing_is_created_for_a_run_refused_before_mlflow(lineage: Lineage) -> None:
    CloseParentRunOnFailure("never-opened")({"dag_run": SimpleNamespace(run_id="m3"),
                                             "exception": ValueError("bad conf")})
    assert lineage.client.get_experiment_by_name("relay/never-opened") is None


def test_a_broken_store_never_makes_the_callback_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_MLFLOW_TRACKING_URI", "sqlite:////proc/no/such/dir/mlflow.db")
    CloseParentRunOnFailure("cb")({"dag_run": SimpleNamespace(run_id="m4")})


def test_every_job_dag_and_its_tasks_close_the_run_on_failure() -> None:
    from relay.operators.dag_factory import build_dag

    demo = REPO_ROOT / "dags" / "jobs" / "demo.yaml"
    dag = build_dag(load_job_spec(demo), demo)
    assert isinstance(dag.on_failure_callback, CloseParentRunOnFailure)
    for task in dag.tasks:
        callbacks = task.on_failure_callback
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        assert any(isinstance(c, CloseParentRunOnFailure) for c in callbacks), task.task_id


def test_a_failed_dag_run_frees_its_nodes_for_the_next_run(
    lineage: Lineage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path))  # the node pool and the runs folder
    pool = NodePool()
    pool.select(2, holder="relay_cb/manual__4")  # kept by a workload handed over at a boundary
    CloseParentRunOnFailure("cb")({"dag_run": SimpleNamespace(
        dag_id="relay_cb", run_id="manual__4"), "reason": "task_failure"})
    assert pool.leases() == {}
