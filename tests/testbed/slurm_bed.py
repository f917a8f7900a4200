"""What the Slurm test-bed tests share: the launch configuration, a launch watched to its
first event, the default policy's decision and its quarantine (and its release), waiting,
freezing a host."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from relay.core.attempt import Attempt
from relay.core.checkpoint_keys import checkpoint_keys
from relay.core.faults import Fault
from relay.launchers.slurm.launcher import SlurmLauncher
from relay.nodes.pool import NodePool
from relay.policy.decide import Decision, decide
from relay.policy.model import Detection, load_policy
from relay.recover.pipeline import quarantine
from relay.tools.bench.common import TINY_MODEL, watch
from relay.tools.testbed import TestBed, procs
from relay.tools.testbed.hosts import ROOT_ADDRESS, ROOT_NAME
from relay_train.protocol.launch import LaunchConfig

NODES = ["node1", "node2", "node3"]
POLICIES = Path(__file__).resolve().parents[2] / "policies"
# This shared 2-core machine runs 3 hosts' agents and ranks at a load of 10-20: agents answer
# late and steps stall for seconds, so the timeouts are wide and the compute-time rules
# (straggler, throughput), which trip on their own here, are out of the way.
DETECTION = Detection(heartbeat_timeout=10.0, hang_timeout=30.0, startup_timeout=300.0,
                      straggler={"ratio": 50}, throughput={"floor": 0.01})


def config(tracking: str, root: Path, nodes: list[str], steps: int, start: int = 0,
           run_id: str | None = None, **extra: Any) -> LaunchConfig:  # noqa: ANN401
    """Return a tiny model's launch on ``nodes``, logging to ``run_id`` (None: a new MLflow
    run); ``extra``: more of LaunchConfig's fields (``resume``, ...)."""
    if run_id is None:
        client = MlflowClient(tracking)
        name = f"slurm-{root.parent.name}-{root.name}-{time.time_ns()}"
        run_id = client.create_run(client.create_experiment(name)).info.run_id
    return LaunchConfig(
        job="slurm", seed=1, model=TINY_MODEL,
        data={"corpus": "builtin:python_docs", "batch_size": 8}, optimizer={"lr": 0.003},
        start_step=start, end_step=steps, checkpoint_every=10**9, nodes=nodes,
        ranks_per_node=1,
        tracking_uri=tracking.replace(ROOT_ADDRESS, ROOT_NAME),  # as the hosts name it
        run_id=run_id, attempt_dir=str(root), attempt=0, segment=0,
        checkpoint_keys=checkpoint_keys().to_dict(), **extra)


def trained(launcher: SlurmLauncher, cfg: LaunchConfig) -> dict[str, Any]:
    """Launch ``cfg``, watch it to its first event, stop it (nothing may survive)."""
    attempt = launcher.launch(cfg)
    try:
        return watch(cfg, DETECTION, timeout=240, launcher=launcher.config())
    finally:
        assert launcher.stop(attempt, grace_seconds=5.0) == []


def until(check: Callable[[], object], timeout: float, what: str) -> None:
    """Wait for ``check()`` to be true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout:.0f} s"
        time.sleep(0.2)


def training(launcher: SlurmLauncher, attempt: Attempt, ranks: int, step: int = 0) -> None:
    """Wait until ``ranks`` ranks of ``attempt`` beat, each past ``step`` (the hosts start
    Python slowly)."""
    def stepping() -> bool:
        beats = launcher.status(attempt).heartbeats
        return len(beats) == ranks and min(b.step for b in beats.values()) >= step

    until(stepping, 180, f"{ranks} ranks training past step {step}")


def decided(event: dict[str, Any], launcher: SlurmLauncher,
            where: str) -> tuple[Fault, Decision]:
    """Return the watcher's fault and the default policy's decision on it, and apply its
    quarantine (Relay's pool, then a Slurm drain) as Relay's recovery does."""
    assert event.get("status") == "faulted", event
    fault = Fault.from_event(event["fault"])
    policy = load_policy(POLICIES / "default.yaml")
    decision = decide(fault, [], policy.policy, policy.sha256)
    quarantine(decision, fault, where, launcher)
    return fault, decision


def drained(launcher: SlurmLauncher, culprit: str, kind: str) -> None:
    """Assert ``culprit`` is drained in Slurm with Relay's reason (its quarantine for a
    fault of ``kind``)."""
    node = launcher.cluster(fresh=True)[culprit]
    assert "DRAIN" in node.states and node.reason.startswith(f"relay: {kind}"), node


def released(launcher: SlurmLauncher, node: str) -> None:
    """Lift the quarantine; Slurm takes the node back (ReturnToService=2 undoes a DOWN)."""
    NodePool().release(node)
    launcher.enforce_quarantines(NodePool().quarantines())
    until(lambda: not launcher.cluster(fresh=True)[node].unfit, 90, f"{node} back in Slurm")


def host_processes(testbed: TestBed, node: str) -> list[int]:
    """Return every process of a host's PID namespace (its slurmd, agent and ranks: they
    were entered with nsenter, so they are not its PID 1's children), but its PID 1."""
    init = testbed.host(node).init
    return [pid for pid in procs.in_pid_namespace(init) if pid != init]


def freeze(testbed: TestBed, node: str, sig: signal.Signals) -> list[int]:
    """Send ``sig`` (SIGSTOP, SIGCONT) to every process of a host but its PID 1."""
    found = []
    for pid in host_processes(testbed, node):
        try:
            os.kill(pid, sig)
            found.append(pid)
        except OSError:
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
