"""The Kubernetes launcher's pods, run exactly as rendered on namespace hosts, train and recover.

Only the API server and the kubelets are FAKES (no API server can run on these
machines): tests/k8s_fake.py stores and validates what the launcher sends, and
tests/k8s_kubelet.py plays the Job controller, the scheduler, the kubelets and
the cluster's DNS. Everything else is real: the launcher (through the provider's
KubernetesHook and the official client) renders the Indexed Job, its ConfigMap,
Secret and headless Service; each pod's container (its command and args, env
with the downward API's fields, the ConfigMap's launch file and the Secrets'
keys mounted where the spec mounts them, emptyDirs, an empty attempt folder,
UID 50000, a read-only root) runs in a namespace host of its own (its own
network on 198.18.0.0/24, hostname, mounts; Relay's RELAY_HOME hidden), finding
its peers by the Service's DNS names in its /etc/hosts. The ranks meet across
hosts over gloo, sign their checkpoints with the Secret the operator created
and publish them to a real MLflow server in the root namespace over HTTP; the
retry's ranks fetch their resume checkpoint from it. The segment trigger
watches the pods' agents over the channel.

A pod is frozen (SIGSTOP of its agent and ranks): the trigger reports ``node_unresponsive``
naming its slot and host, the default policy quarantines the host, and the
retry's Job excludes it (nodeAffinity NotIn): its pods run on the two other
hosts and train to the segment's end from the last checkpoint; rank 0's first
step reaches Relay's attempt folder over the channel, the rank logs MLflow.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from k8s_fake import FakeApiServer
from k8s_kubelet import Kubelets
from k8s_pod_host import can_host_pods

from relay.core.attempt import AttemptState
from relay.core.faults import Fault
from relay.core.proctree import descendants
from relay.launchers import launcher_from
from relay.launchers.k8s.launcher import KubernetesLauncher
from relay.launchers.k8s.objects import KEYS_SECRET, AttemptKey
from relay.lineage.store import Lineage
from relay.nodes.pool import NodePool
from relay.policy.decide import decide
from relay.policy.model import load_policy
from relay.recover.pipeline import quarantine
from relay.tools.mlflow_server import mlflow_server
from relay.tools.testbed import TestBed
from relay.tools.testbed.hosts import ROOT_ADDRESS
from relay.watch.triggers import SegmentWatchTrigger
from relay_train.protocol.launch import FIRST_STEP_FILE, LaunchConfig, ResumeFrom
from relay_train.protocol.routes import AGENT_PORT
from relay_train.protocol.signing import KEYRING_FILE, KeyRing

pytestmark = [pytest.mark.cluster_ns,
              pytest.mark.skipif(bool(can_host_pods()), reason=can_host_pods() or "ok")]
POLICIES = Path(__file__).resolve().parents[2] / "policies"
JOB, DAG, RUN = "k8spods", "relay_k8spods", "manual__2026-12-07T02_00_00_00_00"
END, EVERY = 300, 20
PACE = 0.1  # seconds added to every step, so the freeze lands mid-segment
# Two cores shared by many: a pod's Python takes up to a minute to start, and an agent may
# answer late; the default 2 s of silence would read a busy machine as a dead node.
DETECTION = {"heartbeat_timeout": 8.0, "hang_timeout": 30.0, "startup_timeout": 300.0}
WATCHED = ["node_unresponsive", "rank_unresponsive", "hang", "crash", "launch_failure"]


@pytest.fixture
def cluster(pod_hosts: TestBed, tmp_path: Path, relay_home: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeApiServer, Kubelets]]:
    """The fake API server with the hosts as its nodes, and the kubelets running its pods."""
    monkeypatch.setenv("RELAY_HOME", str(relay_home / "k8s-pods"))  # hidden in the hosts
    monkeypatch.setenv("RELAY_NODES", ",".join(sorted(pod_hosts.hosts)))
    fake = FakeApiServer().start()
    kubelets = Kubelets(fake, pod_hosts, tmp_path / "kubelets").start()
    monkeypatch.setenv("AIRFLOW_CONN_RELAY_K8S", json.dumps(
        {"conn_type": "kubernetes",
         "extra": {"kube_config_path": str(fake.kubeconfig(tmp_path / "kubeconfig"))}}))
    # The cluster's DNS, for Relay's side: the pod's IP instead of its Service name.
    monkeypatch.setattr(KubernetesLauncher, "agent_url", lambda _self, key, index: (
        f"http://{kubelets.address(key.name, index)}:{AGENT_PORT}"))
    try:
        yield fake, kubelets
    finally:
        kubelets.close()
        fake.stop()


def _until(check: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str]) -> Any:  # noqa: ANN401
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s\n{logs()}"
        time.sleep(0.2)
    return found


def _config(root: Path, url: str, run_id: str, nodes: list[str], attempt: int,
            resume: ResumeFrom | None) -> LaunchConfig:
    return LaunchConfig(
        job=JOB, seed=1, model={"context": 16, "n_layers": 1, "n_heads": 2, "d_model": 16,
                                "dropout": 0.0},
        data={"corpus": "builtin:python_docs", "batch_size": 4},
        optimizer={"lr": 0.003, "weight_decay": 0.01},
        start_step=resume.step if resume else 0, end_step=END, checkpoint_every=EVERY,
        nodes=nodes, ranks_per_node=1, tracking_uri=url, run_id=run_id,
        attempt_dir=str(root / f"try-{attempt}"), attempt=attempt, segment=0, resume=resume,
        chaos=[{"kind": "pace", "step": 0, "seconds": PACE, "attempt": None}],
        total_steps=END)


def _first_event(trigger: SegmentWatchTrigger) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        events = trigger.run()
        try:
            return (await events.__anext__()).payload
        finally:
            await events.aclose()
    return asyncio.run(first())


def test_pods_train_on_namespace_hosts_and_a_frozen_pod_is_replaced_elsewhere(
        cluster: tuple[FakeApiServer, Kubelets], tmp_path: Path) -> None:
    fake, kubelets = cluster
    (tmp_path / "mlflow").mkdir()
    ring = KeyRing.generate()  # the operator's Secret relay-checkpoint-key, in the API
    fake.create("secrets", "default", {"metadata": {"name": KEYS_SECRET}, "type": "Opaque",
                                       "stringData": {KEYRING_FILE: json.dumps(ring.to_dict())}})

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((tmp_path / "kubelets").glob("*.log")))

    with mlflow_server(tmp_path / "mlflow", host=ROOT_ADDRESS) as url, \
            ThreadPoolExecutor(1) as pool:
        lineage = Lineage(url, tmp_path / "artifacts")
        parent = lineage.parent_run(JOB, DAG, RUN)
        launcher = launcher_from({"kind": "kubernetes", "conn_id": "relay_k8s",
                                  "image": "relay-worker:test", "cpu": "1", "memory": "2Gi",
                                  "channel_tls_secret": None, "channel_ca_secret": None})
        assert isinstance(launcher, KubernetesLauncher)
        seg = tmp_path / "runs" / DAG / RUN / "segment-000"
        nodes = launcher.slots(["a", "b"])
        cfg = _config(seg, url, lineage.attempt_run(parent, 0, 0, {}), nodes, 0, None)
        attempt = launcher.launch(cfg)
        job = AttemptKey.from_dir(cfg.root).name
        trigger = SegmentWatchTrigger(
            str(cfg.root), {n: [cfg.global_rank(n, 0)] for n in nodes},
            detection=DETECTION, poll_interval_seconds=0.2, kinds=WATCHED,
            launcher=launcher.config())
        watching: Future[dict[str, Any]] = pool.submit(_first_event, trigger)

        # Both pods train across hosts; rank 0 publishes two checkpoints to MLflow.
        _until(lambda: max([m.step for m in lineage.manifests(parent)], default=0) >= EVERY,
               300, "a checkpoint published", logs)
        assert not watching.done(), (watching.result()["fault"]["evidence"], logs())
        frozen_host = kubelets.host_of(job, 1)
        # The whole pod freezes (its agent and its ranks), as a node that stops answering
        # does: with only the agent stopped, the ranks' lockstep with the other pod proves
        # them alive and training goes on (relay.watch.lockstep).
        agent = kubelets.agent_pid(job, 1)
        for pid in [agent, *descendants(agent)]:
            os.kill(pid, signal.SIGSTOP)
        event = watching.result(timeout=60)

        assert event["status"] == "faulted", event
        fault = Fault.from_event(event["fault"])
        assert (fault.kind.value, fault.culprit_node) == ("node_unresponsive", "pod-1"), (
            fault.evidence)
        assert fault.evidence.get("host") in (None, frozen_host), event
        policy = load_policy(POLICIES / "default.yaml")
        decision = decide(fault, [], policy.policy, policy.sha256)
        assert decision.action == "restart_elsewhere", decision
        decision = replace(decision, quarantine_node=launcher.host_of(attempt, "pod-1"))
        assert decision.quarantine_node == frozen_host
        quarantine(decision, fault, f"{DAG}/{RUN}", launcher)
        assert frozen_host in NodePool().quarantines()
        assert launcher.stop(attempt) == []

        latest, corrupt = lineage.resume_point(parent, tmp_path / "resume", ring)
        assert latest is not None and not corrupt and latest.manifest.step >= EVERY
        retry = _config(seg, url, lineage.attempt_run(parent, 0, 1, {}), nodes, 1,
                        latest.resume_from())
        retried = launcher.launch(retry)
        retry_job = AttemptKey.from_dir(retry.root).name
        spec = fake.get("jobs", retry_job)["spec"]["template"]["spec"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [frozen_host]

        _until(lambda: launcher.status(retried).state is AttemptState.COMPLETED, 240,
               "the retry trained to the segment's end", logs)
        hosts = {kubelets.host_of(retry_job, i) for i in range(2)}
        assert frozen_host not in hosts and len(hosts) == 2
        assert max(m.step for m in lineage.manifests(parent)) == END
        # What the pods wrote on their own disks reached Relay: rank 0's first step over
        # the channel (the time to resume's last mark), every rank's log in MLflow.
        first = json.loads((retry.root / FIRST_STEP_FILE).read_text())
        assert first["step"] == latest.manifest.step + 1, first
        _until(lambda: {f.path for f in lineage.client.list_artifacts(retry.run_id, "logs")}
               == {"logs/pod-0", "logs/pod-1"}, 60, "the rank logs in MLflow", logs)
