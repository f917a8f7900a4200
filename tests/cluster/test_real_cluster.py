"""The Kubernetes launcher end to end on a REAL cluster (kind, or any cluster you point at).

Skipped unless RELAY_K8S_E2E_IMAGE names a worker image the cluster can run; it has
never run on the machines this project is developed on (no Docker engine, no API
server). The commands to set a kind cluster up are in docs/kubernetes.md, "Testing
against a real cluster". What it checks that the fake API server cannot: the real
scheduler honours the anti-affinity and the quarantine, pods find each other through
the headless Service's DNS and train to the segment's end, rank 0 publishes its
checkpoint to MLflow from inside the cluster, and a paused node is reported
unresponsive by its kubelet lease / Ready condition.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.core.attempt import Attempt
from relay_train.protocol.routes import NodeState

IMAGE = os.environ.get("RELAY_K8S_E2E_IMAGE")
NAMESPACE = os.environ.get("RELAY_K8S_E2E_NAMESPACE", "relay")
MLFLOW = os.environ.get("RELAY_K8S_E2E_MLFLOW", "http://127.0.0.1:5000")  # from this test
MLFLOW_IN_CLUSTER = os.environ.get("RELAY_K8S_E2E_MLFLOW_IN_CLUSTER",
                                   f"http://mlflow.{NAMESPACE}.svc:5000")  # from the pods
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not IMAGE, reason="needs a real cluster: set RELAY_K8S_E2E_IMAGE "
                       "(see docs/kubernetes.md)"),
]


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    from relay.launchers.k8s.launcher import KubernetesLauncher
    from relay.spec.sections import KubernetesSpec

    kubeconfig = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config"))
    hook = KubernetesHook(conn_id=None, kubernetes_conn_id=None, config_file=kubeconfig)
    launcher = KubernetesLauncher(KubernetesSpec(image=IMAGE, namespace=NAMESPACE,
                                                 active_deadline=900), hook=hook)
    nodes = [n.metadata.name for n in launcher.core.list_node().items
             if not any(t.effect == "NoSchedule" for t in n.spec.taints or [])]
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", ",".join(nodes))
    yield launcher
    launcher.stop_all(tmp_path / "runs" / "relay_e2e" / "run" / "segment-000")


def launch_config(tmp_path: Path, launcher, attempt: int, steps: int):  # noqa: ANN001, ANN201
    from mlflow.tracking import MlflowClient

    from relay_train.protocol.launch import LaunchConfig

    client = MlflowClient(MLFLOW)
    experiment = client.get_experiment_by_name("relay-e2e-k8s")
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(
        "relay-e2e-k8s")
    run_id = client.create_run(experiment_id).info.run_id
    root = tmp_path / "runs" / "relay_e2e" / "run" / "segment-000" / f"try-{attempt}"
    return LaunchConfig(
        job="e2e", seed=1, model={"context": 16, "n_layers": 1, "n_heads": 2, "d_model": 16,
                                  "dropout": 0.0},
        data={"corpus": "builtin:python_docs", "batch_size": 4},
        optimizer={"lr": 0.003, "weight_decay": 0.01}, start_step=0, end_step=steps,
        checkpoint_every=steps, nodes=launcher.slots(["a", "b"]), ranks_per_node=1,
        master_addr="set-by-the-launcher", master_port=0, tracking_uri=MLFLOW_IN_CLUSTER,
        run_id=run_id, attempt_dir=str(root), attempt=attempt, segment=0)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(1)
    return time.monotonic() - started


def test_a_segment_trains_to_its_end_on_two_nodes(tmp_path: Path, launcher) -> None:  # noqa: ANN001
    from mlflow.tracking import MlflowClient

    from relay.core.attempt import Attempt, AttemptState

    cfg = launch_config(tmp_path, launcher, attempt=1, steps=10)
    launcher.launch(cfg)
    hosts: set[str] = set()

    def done() -> bool:
        status = launcher.status(Attempt(cfg.root))
        assert status.state is not AttemptState.FAILED, status
        hosts.update(n.host for n in status.nodes.values() if n.host)
        return status.state is AttemptState.COMPLETED

    wait_for(done, 600, "the Job to succeed")
    assert len(hosts) == 2, f"anti-affinity: expected 2 nodes, found {hosts}"
    artifacts = MlflowClient(MLFLOW).list_artifacts(cfg.run_id, "checkpoints")
    assert artifacts, "rank 0 published no checkpoint from inside the cluster"
    assert launcher.stop(Attempt(cfg.root)) == []


def test_a_quarantined_node_gets_no_pod(tmp_path: Path, launcher) -> None:  # noqa: ANN001
    from relay.nodes.pool import NodePool

    pool = NodePool()
    assert len(pool.nodes) >= 3, "needs 3 schedulable nodes (tests/cluster/kind.yaml)"
    pool.quarantine(pool.nodes[0], 600, reason="e2e", by="test")
    cfg = launch_config(tmp_path, launcher, attempt=2, steps=10)
    launcher.launch(cfg)

    wait_for(lambda: all(n.host for n in launcher.status(Attempt(cfg.root)).nodes.values()), 300,
             "both pods to be scheduled")
    hosts = {n.host for n in launcher.status(Attempt(cfg.root)).nodes.values()}
    assert pool.nodes[0] not in hosts
    assert launcher.stop(Attempt(cfg.root)) == []


def test_a_paused_node_is_unresponsive_long_before_eviction(tmp_path: Path, launcher) -> None:  # noqa: ANN001
    """kind nodes are containers: `docker pause` freezes the kubelet and the pods alike."""

    cfg = launch_config(tmp_path, launcher, attempt=3, steps=100_000)
    attempt = launcher.launch(cfg)
    wait_for(lambda: launcher.status(attempt).nodes["pod-1"].state == NodeState.RUNNING, 300,
             "pod-1 to run")
    host = launcher.host_of(attempt, "pod-1")
    subprocess.run(["docker", "pause", host], check=True)
    try:
        seconds = wait_for(
            lambda: launcher.status(attempt).nodes["pod-1"].state == NodeState.UNRESPONSIVE,
            120,
            f"{host} to be reported unresponsive")
        print(f"{host} paused: unresponsive after {seconds:.0f}s "
              f"({launcher.status(Attempt(cfg.root)).nodes['pod-1'].detail})")
    finally:
        subprocess.run(["docker", "unpause", host], check=False)
    assert launcher.stop(Attempt(cfg.root)) == []
