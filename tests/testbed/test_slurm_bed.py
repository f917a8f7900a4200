"""The Slurm launcher on the test bed's real Slurm: a segment trains on node1..node3, whose
hosts cannot read Relay's disk (the launch file travels in the batch script, the ranks
reach MLflow over the bridge at relay-root); a frozen node is detected, its attempt
cancelled with scancel, and the quarantine drains it in Slurm and resumes it."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from relay.core.attempt import Attempt
from relay.core.checkpoint_keys import checkpoint_keys
from relay.launchers import launcher_from
from relay.launchers.slurm.launcher import SlurmLauncher
from relay.nodes.pool import NodePool
from relay.policy.model import Detection
from relay.spec.slurm import SlurmSpec
from relay.tools.bench.common import TINY_MODEL, watch
from relay.tools.mlflow_server import mlflow_server
from relay.tools.testbed import TestBed, slurm
from relay.tools.testbed.hosts import ROOT_ADDRESS, ROOT_NAME
from relay_train.protocol.launch import FIRST_STEP_FILE, LAUNCH_FILE, LaunchConfig

pytestmark = pytest.mark.cluster_ns
NODES = ["node1", "node2", "node3"]
# This shared 2-core machine runs 3 hosts' agents and ranks at a load of 10-20: agents answer
# late and steps stall for seconds, so the timeouts are wide and the compute-time rules
# (straggler, throughput), which trip on their own here, are out of the way.
DETECTION = Detection(heartbeat_timeout=10.0, hang_timeout=30.0, startup_timeout=300.0,
                      straggler={"ratio": 50}, throughput={"floor": 0.01})


@pytest.fixture(scope="module")
def tracking(testbed: TestBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An MLflow server in the root namespace on the bridge; yield its URL as Relay sees it."""
    root = tmp_path_factory.mktemp("mlflow-bridge")
    with mlflow_server(root, host=ROOT_ADDRESS,
                       allowed_hosts=f"{ROOT_NAME}:*,{ROOT_ADDRESS}:*") as url:
        yield url


@pytest.fixture
def launcher(testbed: TestBed, monkeypatch: pytest.MonkeyPatch) -> SlurmLauncher:
    monkeypatch.setenv("RELAY_NODES", ",".join(NODES))
    settings = SlurmSpec(node_home=f"{testbed.folder}/hosts/{{node}}/attempts",
                         python=sys.executable, linger=5.0,
                         slurm_conf=slurm.slurm_env(testbed)["SLURM_CONF"])
    found = launcher_from({"kind": "slurm", **settings.model_dump()})
    assert isinstance(found, SlurmLauncher)
    return found


def config(tracking: str, root: Path, nodes: list[str], steps: int) -> LaunchConfig:
    client = MlflowClient(tracking)
    name = f"slurm-{root.parent.name}-{root.name}-{time.time_ns()}"
    run_id = client.create_run(client.create_experiment(name)).info.run_id
    return LaunchConfig(
        job="slurm", seed=1, model=TINY_MODEL,
        data={"corpus": "builtin:python_docs", "batch_size": 8}, optimizer={"lr": 0.003},
        start_step=0, end_step=steps, checkpoint_every=10**9, nodes=nodes, ranks_per_node=1,
        tracking_uri=tracking.replace(ROOT_ADDRESS, ROOT_NAME),  # as the hosts name it
        run_id=run_id, attempt_dir=str(root), attempt=0, segment=0,
        checkpoint_keys=checkpoint_keys().to_dict())


def trained(launcher: SlurmLauncher, cfg: LaunchConfig) -> dict[str, Any]:
    """Launch ``cfg``, watch it to its first event, stop it (nothing may survive)."""
    attempt = launcher.launch(cfg)
    try:
        return watch(cfg, DETECTION, timeout=240, launcher=launcher.config())
    finally:
        assert launcher.stop(attempt, grace_seconds=5.0) == []


def _until(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout:.0f} s"
        time.sleep(0.2)


def test_a_segment_trains_on_three_hosts_through_slurm_and_finishes(
        testbed: TestBed, tracking: str, launcher: SlurmLauncher, relay_home: Path) -> None:
    root = relay_home / "slurm" / "dag" / "run-1" / "segment-000" / "try-0"
    cfg = config(tracking, root, NODES, steps=6)
    event = trained(launcher, cfg)
    assert event["status"] == "completed", event
    # The ranks wrote nothing on Relay's disk (rank 0's first step came over the channel);
    # each node's launch file is in its own home.
    assert sorted(p.name for p in root.iterdir()) == [FIRST_STEP_FILE, "handle.json", LAUNCH_FILE]
    for node in NODES:
        local = Path(testbed.host(node).home) / "attempts" / cfg.fence_id
        assert LaunchConfig.read(local / LAUNCH_FILE).attempt_dir == str(local)
    history = MlflowClient(tracking).get_metric_history(cfg.run_id, "loss")
    assert max(m.step for m in history) >= 5, history


def _freeze(testbed: TestBed, node: str, sig: signal.Signals) -> list[int]:
    """Signal every process of a host's PID namespace (its slurmd, agent and ranks; they
    were entered with nsenter, so they are not its PID 1's children), not its PID 1."""
    host = testbed.host(node)
    ns = os.readlink(f"/proc/{host.init}/ns/pid")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == host.init:
            continue
        try:
            if os.readlink(entry / "ns" / "pid") == ns:
                os.kill(int(entry.name), sig)
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to look at (PID 1 of this container)
            pass
    assert found, f"no process found on host {node}"
    if sig == signal.SIGCONT:
        # nsenter, which started slurmd from the root namespace, stopped itself when its
        # child stopped (util-linux mirrors it): it must go on too, or it never reaps slurmd.
        for pid in found:
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if Path(f"/proc/{parent}/comm").read_text().strip() == "nsenter":
                    os.kill(parent, sig)
            except OSError:
                pass
    return found


def test_a_frozen_node_is_cancelled_quarantined_drained_and_the_retry_excludes_it(
        testbed: TestBed, tracking: str, launcher: SlurmLauncher, relay_home: Path) -> None:
    segment = relay_home / "slurm" / "dag" / "run-2" / "segment-000"
    cfg = config(tracking, segment / "try-0", NODES, steps=100_000)
    attempt = launcher.launch(cfg)
    pool = NodePool(nodes=NODES)
    try:
        _until(lambda: len(launcher.status(attempt).heartbeats) == 3, 180, "3 ranks training")
        _freeze(testbed, "node3", signal.SIGSTOP)
        event = watch(cfg, DETECTION, timeout=60, launcher=launcher.config())
        fault = event.get("fault") or {}
        assert (fault.get("kind"), fault.get("culprit_node")) == ("node_unresponsive", "node3"), \
            event
        assert launcher.stop(attempt, grace_seconds=2.0) == []
        assert launcher.slurm.job(launcher.handle(attempt)["job_id"]).state != "RUNNING"

        pool.quarantine("node3", 600, "node_unresponsive", by="test")
        launcher.enforce_quarantines(pool.quarantines())
        node3 = launcher.cluster(fresh=True)["node3"]
        assert "DRAIN" in node3.states and node3.reason.startswith("relay: node_unresponsive")

        retry_cfg = config(tracking, segment / "try-1", pool.healthy(), steps=4)
        assert retry_cfg.nodes == ["node1", "node2"]
        done = trained(launcher, retry_cfg)
        assert done["status"] == "completed", done
        job = launcher.slurm.job(launcher.handle(Attempt(retry_cfg.root))["job_id"])
        assert job is not None and sorted(job.nodes) == ["node1", "node2"]
    finally:
        _freeze(testbed, "node3", signal.SIGCONT)
        launcher.stop(attempt, grace_seconds=1.0)
    pool.release("node3")
    launcher.enforce_quarantines(pool.quarantines())
    _until(lambda: not launcher.cluster(fresh=True)["node3"].unfit, 60, "node3 back in Slurm")

