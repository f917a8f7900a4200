"""A failed MLflow metric write never fails a checkpoint, a rank or a recorded decision."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from tenacity import Retrying, stop_after_attempt, wait_none

from relay.core.checkpoint_keys import checkpoint_keys
from relay_train.checkpoints.checkpointer import Checkpointer
from relay_train.checkpoints.publish import MlflowCheckpointSink

KEYS = checkpoint_keys()  # the test session's key ring ($RELAY_HOME's key file)

def no_wait(attempts: int) -> Retrying:
    return Retrying(stop=stop_after_attempt(attempts), wait=wait_none(), reraise=True)


@pytest.fixture
def run(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("outage", (tmp_path / "artifacts").as_uri())
    return uri, client.create_run(exp).info.run_id


def test_metrics_that_mlflow_refuses_are_dropped_and_checkpoints_still_publish(
    run: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri, run_id = run
    tries: list[int] = []

    def outage(self: MlflowClient, *args: object, **kwargs: object) -> None:
        tries.append(1)
        raise MlflowException("connection reset by peer")

    monkeypatch.setattr(MlflowClient, "log_batch", outage)
    sink = MlflowCheckpointSink(uri, run_id, retrying=no_wait(3), optional_retrying=no_wait(3))
    checkpointer = Checkpointer(sink, tmp_path / "staging", job="outage", world_size=1,
                                parent=None, keys=KEYS, asynchronous=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="relay_train.checkpoints.publish"):
        for step in (1, 2):  # two metric batches fail, each retried three times, then dropped
            checkpointer.submit(lambda step=step: sink.log_metrics([(step, {"loss": 1.0}, 0)]))
        checkpointer.save(model, optimizer, 2, {})
        checkpointer.close(timeout_seconds=60)  # raises if anything in the queue failed
    assert len(tries) == 6 and sink.dropped == 2
    assert caplog.text.count("Dropped metrics") == 1  # logged once, then counted
    names = [a.path for a in MlflowClient(uri).list_artifacts(run_id, "checkpoints")]
    assert names, "the checkpoint was published despite the metric outage"


def test_an_unreachable_store_at_start_up_does_not_fail_the_rank(
    run: tuple[str, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri, run_id = run

    def down(self: MlflowClient, *args: object) -> None:
        raise MlflowException("503 Service Unavailable")

    monkeypatch.setattr(MlflowClient, "get_run", down)
    MlflowCheckpointSink(uri, run_id, optional_retrying=no_wait(2)).connect()  # no raise


def test_an_mlflow_outage_never_turns_the_policys_decision_into_a_default_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    import json
    from types import SimpleNamespace

    from relay.core.attempt import Attempt
    from relay.core.faults import Fault, FaultKind
    from relay.core.settings import REPO_ROOT
    from relay.launchers import launcher_for
    from relay.lineage.store import Lineage
    from relay.operators.retry import SegmentFaultError
    from relay.operators.segment import TrainSegmentOperator
    from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", "node-a")  # too few for a warm standby: nothing spawned
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    (tmp_path / "p.yaml").write_text((REPO_ROOT / "policies" / "default.yaml").read_text())
    spec = tmp_path / "job.yaml"
    spec.write_text("job: outage\ntotal_steps: 20\nsteps_per_segment: 20\ncheckpoint_every: 10\n"
                    "policy: p.yaml\n")
    attempt = tmp_path / "runs" / "segment-000" / "try-1"
    attempt.mkdir(parents=True)
    cfg = LaunchConfig(
        job="outage", seed=0, model={}, data={}, optimizer={}, start_step=0, end_step=20,
        checkpoint_every=10, nodes=["node-a", "node-b"], ranks_per_node=1,
        master_addr="127.0.0.1", master_port=1, tracking_uri="http://127.0.0.1:9",
        run_id="r1", attempt_dir=str(attempt), attempt=1, segment=0)
    cfg.write(attempt / LAUNCH_FILE)
    down = Lineage("http://127.0.0.1:9", tmp_path / "artifacts", retrying=no_wait(2))
    op = TrainSegmentOperator(task_id="segment_000", segment=0, spec_file=str(spec))
    context = {"dag_run": SimpleNamespace(run_id="manual__1", conf={})}
    crash = Fault(FaultKind.CRASH, 1, "node-b", {"summary": "exit -9"}, 1000.0)
    with pytest.raises(SegmentFaultError) as raised:  # the policy's retry, not MLflow's error
        op._recover(context, crash, Attempt(attempt), cfg, down, launcher_for(op.spec()),
                    act=True)
    assert raised.value.decision.action == "retry"
    assert str(raised.value).endswith("lost steps unknown")
    record = json.loads((attempt / "decision.json").read_text())
    assert record["decision"]["action"] == "retry" and record["lost_steps"] is None
    logged = capfd.readouterr()  # once Airflow configures logging, it writes to the console
    assert "Could not log decision.json in MLflow after retries" in (
        logged.out + logged.err + caplog.text)


def test_a_flush_of_several_steps_is_one_request_with_every_steps_metrics(
    run: tuple[str, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request a flush, not one a step: each held rank 0's GIL beside its loop."""
    uri, run_id = run
    requests: list[int] = []
    log_batch = MlflowClient.log_batch

    def counted(self: MlflowClient, *args: object, **kwargs: object) -> None:
        requests.append(len(kwargs.get("metrics") or []))  # type: ignore[arg-type]
        log_batch(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MlflowClient, "log_batch", counted)
    sink = MlflowCheckpointSink(uri, run_id)
    sink.log_metrics([(step, {"loss": 1.0 / step, "step_seconds": 0.1}, 1000 + step)
                      for step in range(1, 6)])
    assert requests == [10]
    history = MlflowClient(uri).get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in range(1, 6)]
    sink.log_metrics([])  # nothing to send: no request
    assert requests == [10]


def test_rank_zero_sends_its_metrics_every_five_steps_but_at_most_every_two_seconds() -> None:
    """Slow steps: a flush every METRICS_EVERY steps; fast ones: one a METRICS_SECONDS."""
    from relay_train.api import METRICS_EVERY, METRICS_SECONDS, metrics_due

    assert metrics_due(METRICS_EVERY, -math.inf, 0.0)  # the first flush waits for no clock
    assert not metrics_due(METRICS_EVERY - 1, -math.inf, 100.0)
    assert not metrics_due(50 * METRICS_EVERY, 100.0, 100.0 + METRICS_SECONDS / 2)
    assert metrics_due(METRICS_EVERY, 100.0, 100.0 + METRICS_SECONDS)
