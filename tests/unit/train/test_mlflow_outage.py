"""A failed MLflow metric write never fails a checkpoint, a rank or a recorded decision."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from tenacity import Retrying, stop_after_attempt, wait_none

from relay.core.checkpoint_keys import checkpoint_keys
from relay_train.checkpoints.checkpointer import Checkpointer
from relay_train.checkpoints.publish import MlflowCheckpointSink
from relay_train.metrics import (
    METRICS_EVERY,
    METRICS_SECONDS,
    MIN_STALL_SECONDS,
    Batch,
    PendingMetrics,
    stall_seconds,
)
from relay_train.protocol.heartbeat import HeartbeatWriter

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
    """Slow steps: a batch every METRICS_EVERY steps; fast ones: one a METRICS_SECONDS."""
    sent: list[Batch] = []
    pending = PendingMetrics(sent.append)
    for step in range(METRICS_EVERY - 1):
        pending.add(step, {"loss": 1.0})
    assert not pending.due(time.monotonic() + 100)
    pending.add(METRICS_EVERY, {"loss": 1.0})
    assert pending.due(time.monotonic())  # the first batch waits for no clock
    pending.flush()
    assert [len(b) for b in sent] == [METRICS_EVERY]
    for step in range(50 * METRICS_EVERY):
        pending.add(step, {"loss": 1.0})
    assert not pending.due(pending.sent_at + METRICS_SECONDS / 2)
    assert pending.due(pending.sent_at + METRICS_SECONDS)
    pending.flush()
    pending.flush()  # nothing kept: nothing sent
    assert [len(b) for b in sent] == [METRICS_EVERY, 50 * METRICS_EVERY]


def test_figures_a_stalled_loop_holds_back_count_as_stalled_after_three_step_times() -> None:
    pending = PendingMetrics(lambda _batch: None)
    assert not pending.stalled(time.monotonic() + 100, 0.1), "nothing held back"
    pending.add(1, {"loss": 1.0})
    added = pending.added_at
    assert stall_seconds(None) == stall_seconds(0.01) == MIN_STALL_SECONDS
    assert stall_seconds(1.0) == 3.0
    assert not pending.stalled(added + 2.9, 1.0)
    assert pending.stalled(added + 3.0, 1.0)
    assert pending.stalled(added + MIN_STALL_SECONDS, 0.05)


def test_the_heartbeat_writer_runs_its_after_write_call_in_its_thread(tmp_path: Path) -> None:
    """What sends a stalled loop's metrics: called after each periodic write, and a call
    that raises stops neither the writer nor the next call."""
    calls: list[str] = []
    twice = threading.Event()

    def call() -> None:
        calls.append(threading.current_thread().name)
        if len(calls) >= 2:
            twice.set()
        raise RuntimeError("the writer goes on")

    writer = HeartbeatWriter(tmp_path, rank=0, node="n0", interval_seconds=0.05)
    writer.after_each_write(call)
    writer.start()
    try:
        assert twice.wait(60)
    finally:
        writer.close()
    assert set(calls) == {"heartbeat-0"}
