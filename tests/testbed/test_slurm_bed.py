"""The Slurm launcher on the test bed's real Slurm: a segment trains on node1..node3, whose
hosts cannot read Relay's disk (the launch file travels in the batch script, the ranks
reach MLflow over the bridge at relay-root); a frozen node is detected, its attempt
cancelled with scancel, and the quarantine drains it in Slurm and resumes it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from slurm_bed import DETECTION, NODES, config, freeze, trained, until

from relay.core.attempt import Attempt
from relay.launchers.slurm.launcher import SlurmLauncher
from relay.nodes.pool import NodePool
from relay.tools.bench.common import watch
from relay.tools.testbed import TestBed
from relay_train.protocol.launch import FIRST_STEP_FILE, LAUNCH_FILE, LaunchConfig

pytestmark = pytest.mark.cluster_ns


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


def test_a_frozen_node_is_cancelled_quarantined_drained_and_the_retry_excludes_it(
        testbed: TestBed, tracking: str, launcher: SlurmLauncher, relay_home: Path) -> None:
    segment = relay_home / "slurm" / "dag" / "run-2" / "segment-000"
    cfg = config(tracking, segment / "try-0", NODES, steps=100_000)
    attempt = launcher.launch(cfg)
    pool = NodePool(nodes=NODES)
    try:
        until(lambda: len(launcher.status(attempt).heartbeats) == 3, 180, "3 ranks training")
        freeze(testbed, "node3", signal.SIGSTOP)
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
        freeze(testbed, "node3", signal.SIGCONT)
        launcher.stop(attempt, grace_seconds=1.0)
    pool.release("node3")
    launcher.enforce_quarantines(pool.quarantines())
    until(lambda: not launcher.cluster(fresh=True)["node3"].unfit, 60, "node3 back in Slurm")

