"""KubernetesLauncher against a fake API server (tests/k8s_fake.py), through the real client.

A FAKE stands in for the cluster here: no kube-apiserver can run on these
machines. The launcher, the provider's KubernetesHook and the official
``kubernetes`` client are the real ones, speaking HTTP to 127.0.0.1. What a
real cluster adds (scheduling, kubelets, DNS, images) is in docs/kubernetes.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from agents import FrozenAgent, ServedAttempt
from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from k8s_fake import FakeApiServer

from relay.core.attempt import Attempt, AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers import launcher_from
from relay.launchers.k8s.launcher import KubernetesLauncher
from relay.launchers.k8s.objects import QUARANTINE_TAINT_KEY, AttemptKey
from relay.nodes.pool import NodePool
from relay.policy.decide import decide
from relay.policy.model import Detection, load_policy
from relay.recover.pipeline import quarantine
from relay.spec.sections import KubernetesSpec
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.protocol.launch import LaunchConfig
from relay_train.protocol.routes import NodeState

HOSTS = ["gpu-1", "gpu-2", "gpu-3"]
POLICIES = Path(__file__).resolve().parents[3] / "policies"
RUN = "manual__2026-12-03T05_00_00_00_00"


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    for host in HOSTS:
        server.add_node(host)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def node_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NodePool:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", ",".join(HOSTS))
    return NodePool()


def make_launcher(fake: FakeApiServer, tmp_path: Path, **settings: object) -> KubernetesLauncher:
    hook = KubernetesHook(conn_id=None, kubernetes_conn_id=None,
                          config_file=str(fake.kubeconfig(tmp_path / "kubeconfig")))
    # The pods' agents here are clear-text servers on loopback: the channel's TLS (on by
    # default) is tested in tests/security/test_k8s_channel_tls.py.
    settings = {"channel_tls_secret": None, "channel_ca_secret": None, **settings}
    spec = KubernetesSpec(image="registry.example.com/relay-worker:0.1.0", **settings)
    launcher = KubernetesLauncher(spec, hook=hook, retry_wait_seconds=0)
    launcher.node_check_seconds = 0  # see every change at once
    return launcher


def make_cfg(tmp_path: Path, launcher: KubernetesLauncher, segment: int = 1,
             attempt: int = 2) -> LaunchConfig:
    root = tmp_path / "runs" / "relay_k8sdemo" / RUN / f"segment-{segment:03d}" / f"try-{attempt}"
    return LaunchConfig(
        job="k8sdemo", seed=1, model={}, data={}, optimizer={}, start_step=60, end_step=120,
        checkpoint_every=20, nodes=launcher.slots(["gpu-1", "gpu-2"]), ranks_per_node=2,
        master_addr="127.0.0.1", master_port=1, tracking_uri="http://mlflow:5000",
        run_id="abc", attempt_dir=str(root), attempt=attempt, segment=segment)


def launched(fake: FakeApiServer, launcher: KubernetesLauncher, tmp_path: Path,
             hosts: list[str]) -> tuple[LaunchConfig, str]:
    """Launch an attempt and have the fake cluster run its pods on ``hosts``."""
    cfg = make_cfg(tmp_path, launcher)
    launcher.launch(cfg)
    name = AttemptKey.from_dir(cfg.root).name
    fake.run_pods(name, hosts)
    return cfg, name


def observe(launcher: KubernetesLauncher, cfg: LaunchConfig) -> Observation:
    node_ranks = {n: [cfg.global_rank(n, r) for r in range(cfg.ranks_per_node)]
                  for n in cfg.nodes}
    attempt = Attempt(cfg.root)
    return Observation(now=launcher.started_at(attempt) + 1,
                       launched_at=launcher.started_at(attempt), heartbeats={},
                       node_ranks=node_ranks, heartbeat_interval=0.5,
                       launch=launcher.status(attempt))


def test_launch_creates_an_indexed_job_its_service_and_configmap(
    fake: FakeApiServer, tmp_path: Path, node_pool: NodePool
) -> None:
    node_pool.quarantine("gpu-3", 600, reason="ECC errors", by="test")
    launcher = make_launcher(fake, tmp_path, gpus_per_pod=4, active_deadline=3600)
    cfg = make_cfg(tmp_path, launcher)

    launcher.launch(cfg)

    name = AttemptKey.from_dir(cfg.root).name
    job = fake.get("jobs", name)
    assert job is not None, "no Job created"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 3600
    labels = job["metadata"]["labels"]
    assert labels["relay.dev/segment"] == "1" and labels["relay.dev/attempt"] == "2"
    assert labels["relay.dev/dag-id"] == "relay_k8sdemo"
    pod = spec["template"]["spec"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"] == [{"matchFields": [
            {"key": "metadata.name", "operator": "NotIn", "values": ["gpu-3"]}]}]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert pod["subdomain"] == name
    owner = [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
              "uid": job["metadata"]["uid"], "blockOwnerDeletion": True}]
    service, configmap = fake.get("services", name), fake.get("configmaps", name)
    assert service["metadata"]["ownerReferences"] == owner
    assert service["spec"]["clusterIP"] == "None"
    assert configmap["metadata"]["ownerReferences"] == owner
    pod_cfg = json.loads(configmap["data"]["launch.json"])
    assert pod_cfg["master_addr"] == f"{name}-0.{name}" and pod_cfg["master_port"] == 29500
    assert pod_cfg["attempt_dir"] == "/relay/attempt"
    assert LaunchConfig.read(cfg.root / "launch.json").attempt_dir == cfg.attempt_dir


def test_a_retried_launch_reattaches_to_its_job(fake: FakeApiServer, tmp_path: Path) -> None:
    launcher = make_launcher(fake, tmp_path)
    cfg = make_cfg(tmp_path, launcher)
    launcher.launch(cfg)
    uid = fake.items("jobs")[0]["metadata"]["uid"]

    launcher.launch(cfg)  # e.g. the first reply was lost and the task tried again

    jobs = fake.items("jobs")
    assert [j["metadata"]["uid"] for j in jobs] == [uid]
    assert len(fake.items("services")) == 1 and len(fake.items("configmaps")) == 1
    posts = [p for m, p in fake.requests if m == "POST" and p.endswith("/jobs")]
    assert len(posts) == 2  # the second create met 409 and re-attached


def test_a_launch_waits_for_a_same_named_job_still_being_deleted(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    from kubernetes import client

    launcher = make_launcher(fake, tmp_path)
    cfg, name = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])
    old_uid = fake.get("jobs", name)["metadata"]["uid"]
    fake.slow_nodes["gpu-2"] = 1.0  # its pod takes a second to go
    launcher.batch.delete_namespaced_job(
        name, "default", body=client.V1DeleteOptions(propagation_policy="Foreground"))
    assert fake.get("jobs", name)["metadata"].get("deletionTimestamp")

    launcher.launch(cfg)

    new = fake.get("jobs", name)
    assert new is not None and new["metadata"]["uid"] != old_uid
    assert not new["metadata"].get("deletionTimestamp")


def test_status_follows_pods_to_success(fake: FakeApiServer, tmp_path: Path) -> None:
    launcher = make_launcher(fake, tmp_path)
    cfg = make_cfg(tmp_path, launcher)
    launcher.launch(cfg)
    name = AttemptKey.from_dir(cfg.root).name

    starting = launcher.status(Attempt(cfg.root))
    assert starting.state is AttemptState.RUNNING
    assert {n.state for n in starting.nodes.values()} == {NodeState.STARTING}

    fake.run_pods(name, ["gpu-2", "gpu-1"])
    running = launcher.status(Attempt(cfg.root))
    assert running.state is AttemptState.RUNNING
    assert {n: (s.state, s.host) for n, s in running.nodes.items()} == {
        "pod-0": (NodeState.RUNNING, "gpu-2"), "pod-1": (NodeState.RUNNING, "gpu-1")}
    assert launcher.host_of(Attempt(cfg.root), "pod-0") == "gpu-2"

    fake.set_phase(name, 0, "Succeeded", 0)
    fake.set_phase(name, 1, "Succeeded", 0)
    assert launcher.status(Attempt(cfg.root)).state is AttemptState.COMPLETED


def test_a_failed_pod_is_a_crash_of_its_node(fake: FakeApiServer, tmp_path: Path) -> None:
    launcher = make_launcher(fake, tmp_path)
    cfg, name = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])
    fake.set_phase(name, 1, "Failed", 137)

    obs = observe(launcher, cfg)
    fault = Detector(Detection()).check(obs)

    assert obs.launch.state is AttemptState.FAILED
    assert "agent exited with code 137" in obs.launch.nodes["pod-1"].detail
    assert fault is not None and fault.kind is FaultKind.CRASH
    assert fault.culprit_node == "pod-1"


def test_an_evicted_pod_is_a_preemption_of_its_node_not_a_crash(
        fake: FakeApiServer, tmp_path: Path) -> None:
    """What the cluster does on an eviction (kubernetes.io/docs/tasks/job/pod-failure-policy):
    the pod gets DisruptionTarget and fails, the Job's FailJob rule fails the Job."""
    launcher = make_launcher(fake, tmp_path)
    cfg, name = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])
    pod = fake.pod_of(name, 1)["metadata"]["name"]
    fake.update_pod(pod, {"conditions": [{"type": "DisruptionTarget", "status": "True",
                                          "reason": "EvictionByEvictionAPI",
                                          "message": "Eviction API: evicting"}]})
    fake.set_phase(name, 1, "Failed", 143)
    fake.fail_job(name, "PodFailurePolicy", f"Pod default/{pod} has condition "
                  "DisruptionTarget matching FailJob rule at index 0")

    obs = observe(launcher, cfg)
    fault = Detector(Detection()).check(obs)

    assert obs.launch.state is AttemptState.FAILED
    assert obs.launch.nodes["pod-1"].detail.startswith(
        f"preempted: pod {pod} on gpu-2: EvictionByEvictionAPI"), obs.launch.nodes["pod-1"]
    assert fault is not None and fault.culprit_node == "pod-1"
    assert fault.evidence["preempted"] == {"pod-1": obs.launch.nodes["pod-1"].detail}


def test_job_deadline_exceeded_fails_the_attempt(fake: FakeApiServer, tmp_path: Path) -> None:
    launcher = make_launcher(fake, tmp_path)
    cfg, name = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])
    fake.fail_job(name, "DeadlineExceeded", "Job was active longer than specified deadline")

    status = launcher.status(Attempt(cfg.root))

    assert status.state is AttemptState.FAILED
    assert "DeadlineExceeded" in status.nodes["pod-0"].detail


def test_not_ready_node_is_node_unresponsive_and_quarantined_by_taint_and_affinity(
    fake: FakeApiServer, tmp_path: Path, node_pool: NodePool
) -> None:
    launcher = make_launcher(fake, tmp_path, taint_quarantine=True)
    cfg, name = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])
    fake.set_ready("gpu-2", False)

    obs = observe(launcher, cfg)
    fault = Detector(Detection()).check(obs)

    assert obs.launch.nodes["pod-1"].state == NodeState.UNRESPONSIVE
    assert fault is not None and fault.kind is FaultKind.NODE_UNRESPONSIVE
    assert (fault.culprit_node, fault.evidence["host"]) == ("pod-1", "gpu-2")
    assert "NotReady" in fault.evidence["summary"]

    policy = load_policy(POLICIES / "default.yaml")
    decision = decide(fault, [], policy.policy, policy.sha256)
    assert (decision.action, decision.quarantine_node) == ("restart_elsewhere", "pod-1")
    # What TrainSegmentOperator does before stopping the attempt: name the machine.
    decision = replace(decision, quarantine_node=launcher.host_of(Attempt(cfg.root), "pod-1"))
    quarantine(decision, fault, "relay_k8sdemo/run", launcher)

    taints = fake.get("nodes", "gpu-2", None)["spec"]["taints"]
    until = node_pool.quarantines()["gpu-2"].until
    assert until - time.time() == pytest.approx(decision.quarantine_seconds, abs=30)
    assert taints == [{"key": QUARANTINE_TAINT_KEY, "value": str(int(until)),
                       "effect": "NoSchedule"}]
    assert "taints" not in fake.get("nodes", "gpu-1", None)["spec"]
    retry = make_cfg(tmp_path, launcher, attempt=3)
    launcher.launch(retry)
    terms = fake.get("jobs", AttemptKey.from_dir(retry.root).name)["spec"]["template"]["spec"][
        "affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-2"]

    node_pool.release("gpu-2")  # the quarantine ends: the next launch lifts the taint
    launcher.launch(make_cfg(tmp_path, launcher, attempt=4))
    assert fake.get("nodes", "gpu-2", None)["spec"]["taints"] == []


def test_taint_patch_retries_after_a_conflict(
    fake: FakeApiServer, tmp_path: Path, node_pool: NodePool
) -> None:
    launcher = make_launcher(fake, tmp_path, taint_quarantine=True)
    node_pool.quarantine("gpu-1", 60, reason="test", by="test")
    fake.conflicts["gpu-1"] = 1  # someone else changes the node between read and patch

    launcher.enforce_quarantines(node_pool.quarantines())

    assert [t["key"] for t in fake.get("nodes", "gpu-1", None)["spec"]["taints"]] == [
        QUARANTINE_TAINT_KEY]
    patches = [p for m, p in fake.requests if m == "PATCH"]
    assert patches == ["/api/v1/nodes/gpu-1", "/api/v1/nodes/gpu-1"]


def test_kubelet_lease_that_stops_moving_is_node_unresponsive(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    launcher = make_launcher(fake, tmp_path)
    launcher.lease_stale_seconds = 0.3
    cfg, _ = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])
    # first sight of each lease
    assert launcher.status(Attempt(cfg.root)).state is AttemptState.RUNNING

    time.sleep(0.5)
    fake.renew_lease("gpu-1")  # gpu-2's kubelet has gone quiet (still "Ready" for now)
    status = launcher.status(Attempt(cfg.root))

    assert status.nodes["pod-0"].state == NodeState.RUNNING
    assert status.nodes["pod-1"].state == NodeState.UNRESPONSIVE
    assert "has not renewed its lease" in status.nodes["pod-1"].detail


def test_node_health_is_read_every_few_seconds_not_every_poll(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    launcher = make_launcher(fake, tmp_path)
    launcher.node_check_seconds = 60
    cfg, _ = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])

    fake.requests.clear()
    for _ in range(5):  # what the trigger does each poll
        launcher.status(Attempt(cfg.root))
        launcher.started_at(Attempt(cfg.root))

    node_reads = [p for m, p in fake.requests if m == "GET" and p.startswith("/api/v1/nodes/")]
    assert sorted(node_reads) == ["/api/v1/nodes/gpu-1", "/api/v1/nodes/gpu-2"]
    job_reads = [p for m, p in fake.requests if m == "GET" and "/jobs/" in p]
    pod_lists = [p for m, p in fake.requests if m == "GET" and p.endswith("/pods")]
    assert (len(job_reads), len(pod_lists)) == (5 + 1, 5)  # started_at reads the Job once


def test_pod_stuck_terminating_is_node_unresponsive_and_stop_clears_it(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    launcher = make_launcher(fake, tmp_path)
    cfg, name = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-3"])
    fake.mark_terminating(name, 1, since_seconds=60)  # deleted a minute ago, still there

    fault = Detector(Detection()).check(observe(launcher, cfg))
    assert fault is not None and fault.kind is FaultKind.NODE_UNRESPONSIVE
    assert fault.culprit_node == "pod-1" and fault.evidence["host"] == "gpu-3"
    assert "stuck terminating" in fault.evidence["summary"]
    stuck_pod = fake.pod_of(name, 1)["metadata"]["name"]

    survivors = launcher.stop(Attempt(cfg.root), grace_seconds=0)

    assert survivors == []
    assert fake.items("pods") == [] and fake.items("jobs") == []
    assert fake.items("services") == [] and fake.items("configmaps") == []
    # No agent said it stops (none is reachable here): the pod still there after the Job's
    # delete got the stop's grace (0), not its own (a notice's, 30 s), and no later force.
    assert fake.pod_deletes == [(stuck_pod, 0)]
    # 404: the attempt is gone
    assert launcher.status(Attempt(cfg.root)).state is AttemptState.FAILED


def test_stop_watches_pods_until_their_kubelets_finish(fake: FakeApiServer, tmp_path: Path) -> None:
    launcher = make_launcher(fake, tmp_path)
    cfg, _ = launched(fake, launcher, tmp_path, ["gpu-1", "gpu-2"])
    fake.slow_nodes["gpu-2"] = 1.0  # its agent takes a second to stop its ranks

    survivors = launcher.stop(Attempt(cfg.root), grace_seconds=3)

    assert survivors == []
    assert fake.watches == ["pods"]
    assert fake.items("pods") == [] and fake.items("jobs") == []
    assert [g for _, g in fake.pod_deletes] == [3]  # the stop's grace, no forced delete


def test_stop_asks_the_pods_agents_over_the_channel_before_deleting_the_job(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Asked first, an agent takes its pod's SIGTERM as Relay's stop; deleted first, it would
    # take it as a preemption notice and train on for the drain window. pod-1's agent is
    # frozen: the stop goes on without its answer.
    launcher = make_launcher(fake, tmp_path)
    cfg = make_cfg(tmp_path, launcher)
    name = AttemptKey.from_dir(cfg.root).name
    pods = ServedAttempt(cfg.root, {"pod-0": [0, 1]})
    frozen = FrozenAgent()
    try:
        addresses = {**pods.addresses, "pod-1": frozen.address}
        monkeypatch.setattr(launcher, "agent_url", lambda _key, i: addresses[f"pod-{i}"])
        monkeypatch.setattr("relay.launchers.k8s.launcher.new_secret", lambda: pods.secret)
        launcher.launch(cfg)
        fake.run_pods(name, ["gpu-1", "gpu-2"])
        fake_pod_1 = fake.pod_of(name, 1)["metadata"]["name"]
        fake.frozen_nodes.add("gpu-2")  # its kubelet too: the pod stays until deleted again
        job_when_asked: list[bool] = []
        monkeypatch.setattr(pods.nodes["pod-0"], "request_stop", lambda _reason: (
            job_when_asked.append(fake.get("jobs", name) is not None)))

        assert launcher.stop(Attempt(cfg.root), grace_seconds=0) == []

        assert job_when_asked == [True]  # asked while its Job (and pod) still stood
        assert frozen.was_asked()
        assert fake.items("jobs") == [] and fake.items("pods") == []
        # Only the pod whose agent did not answer got the stop's grace instead of its own.
        assert fake.pod_deletes == [(fake_pod_1, 0)]
    finally:
        pods.close()
        frozen.close()


def test_stop_and_status_of_a_missing_job_answer_404_calmly(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    launcher = make_launcher(fake, tmp_path)
    cfg = make_cfg(tmp_path, launcher)

    assert launcher.stop(Attempt(cfg.root)) == []
    status = launcher.status(Attempt(cfg.root))
    assert status.state is AttemptState.FAILED and status.nodes == {}
    with pytest.raises(KeyError):
        launcher.started_at(Attempt(cfg.root))


def test_stop_all_deletes_every_attempt_of_the_segment_only(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    launcher = make_launcher(fake, tmp_path)
    first, second = make_cfg(tmp_path, launcher, attempt=1), make_cfg(tmp_path, launcher, attempt=2)
    other = make_cfg(tmp_path, launcher, segment=2, attempt=1)
    for cfg in (first, second, other):
        launcher.launch(cfg)
        fake.run_pods(AttemptKey.from_dir(cfg.root).name, ["gpu-1", "gpu-2"])

    assert launcher.stop_all(first.root.parent) == []

    assert [j["metadata"]["name"] for j in fake.items("jobs")] == [
        AttemptKey.from_dir(other.root).name]
    assert len(fake.items("pods")) == 2


def test_the_factory_builds_it_from_an_airflow_connection(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("AIRFLOW_CONN_RELAY_K8S", json.dumps(
        {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig)}}))
    launcher = launcher_from({"kind": "kubernetes", "conn_id": "relay_k8s",
                              "image": "registry.example.com/relay-worker:0.1.0",
                              "channel_tls_secret": None, "channel_ca_secret": None})
    cfg = make_cfg(tmp_path, launcher)

    launcher.launch(cfg)

    assert launcher.config()["conn_id"] == "relay_k8s"
    assert [j["metadata"]["name"] for j in fake.items("jobs")] == [
        AttemptKey.from_dir(cfg.root).name]


def test_attempt_names_are_stable_dns_labels() -> None:
    long_run = "manual__2026-12-03T05:00:00.123456+00:00" * 3
    key = AttemptKey("relay_a_very_long_job_name_that_goes_on", long_run, 12, 3)

    assert key.name == AttemptKey.from_dir(
        Path("/x") / key.dag_id / long_run / "segment-012" / "try-3").name
    assert len(key.name) + len("-99") <= 63  # pod hostnames <job>-<index> stay valid
    assert all(len(v) <= 63 for v in key.labels().values())
    with pytest.raises(ValueError, match="segment-NNN/try-N"):
        AttemptKey.from_dir(Path("/tmp/elsewhere"))


def test_fault_round_trip_keeps_the_host() -> None:
    fault = Fault(FaultKind.NODE_UNRESPONSIVE, None, "pod-1", {"summary": "x", "host": "gpu-2"})
    assert Fault.from_event(fault.to_event()["fault"]).evidence["host"] == "gpu-2"


def test_the_fake_refuses_what_a_real_api_server_would(fake: FakeApiServer, tmp_path: Path) -> None:
    from kubernetes.client.exceptions import ApiException

    launcher = make_launcher(fake, tmp_path)
    bad = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": {"template": {"spec": {"containers": [{"name": "a", "imagePolicy": "x"}]}}}}
    with pytest.raises(ApiException) as raised:
        launcher.batch.create_namespaced_job("default", bad)
    assert raised.value.status == 422
    with pytest.raises(ApiException) as missing:
        launcher.core.read_node("gpu-9")
    assert missing.value.status == 404


def test_every_call_the_launcher_makes_is_granted_by_the_shipped_rbac(
    fake: FakeApiServer, tmp_path: Path, node_pool: NodePool
) -> None:
    from kubernetes_validate.utils import resources_from_file

    launcher = make_launcher(fake, tmp_path, taint_quarantine=True)
    node_pool.quarantine("gpu-3", 60, reason="test", by="test")
    cfg = make_cfg(tmp_path, launcher)
    launcher.launch(cfg)
    launcher.launch(cfg)  # the 409 path
    name = AttemptKey.from_dir(cfg.root).name
    fake.run_pods(name, ["gpu-1", "gpu-2"])
    fake.mark_terminating(name, 1, since_seconds=60)
    launcher.status(Attempt(cfg.root))
    launcher.host_of(Attempt(cfg.root), "pod-0")
    launcher.started_at(Attempt(cfg.root))
    fake.slow_nodes["gpu-1"] = 0.2
    launcher.stop(Attempt(cfg.root), grace_seconds=1)  # > 0: the pods are watched going
    launcher.stop_all(cfg.root.parent)

    deploy = Path(__file__).resolve().parents[3] / "deploy"
    docs = [*resources_from_file(str(deploy / "rbac.yaml")),  # taint_quarantine is on: both
            *resources_from_file(str(deploy / "rbac-taint-quarantine.yaml"))]
    granted = {(group, resource, verb)
               for doc in docs if doc["kind"].endswith("Role")
               for rule in doc["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert fake.verbs <= granted, f"not granted: {sorted(fake.verbs - granted)}"
    assert ("batch", "jobs", "create") in fake.verbs and ("", "pods", "watch") in fake.verbs


def test_the_segment_trigger_watches_a_job_and_fires_node_unresponsive(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import importlib

    from relay.watch.triggers import SegmentWatchTrigger

    monkeypatch.setenv("AIRFLOW_CONN_RELAY_K8S", json.dumps(
        {"conn_type": "kubernetes",
         "extra": {"kube_config_path": str(fake.kubeconfig(tmp_path / "kubeconfig"))}}))
    launcher = launcher_from({"kind": "kubernetes", "conn_id": "relay_k8s",
                              "image": "registry.example.com/relay-worker:0.1.0",
                              "channel_tls_secret": None, "channel_ca_secret": None})
    cfg, name = launched(fake, launcher, tmp_path, ["gpu-3", "gpu-1"])
    node_ranks = {n: [cfg.global_rank(n, r) for r in range(2)] for n in cfg.nodes}
    trigger = SegmentWatchTrigger(str(cfg.root), node_ranks, poll_interval_seconds=0.05,
                                  launcher=launcher.config())
    classpath, kwargs = trigger.serialize()  # what the triggerer stores and rebuilds from
    module, _, cls = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), cls)(**json.loads(json.dumps(kwargs)))

    async def first_event() -> dict:
        events = rebuilt.run()
        pending = asyncio.ensure_future(events.__anext__())
        try:
            for _ in range(300):  # let it poll the healthy Job a few times
                if sum(m == "GET" and f"/jobs/{name}" in p for m, p in fake.requests) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert not pending.done(), pending.result().payload  # nothing to report yet
            fake.set_ready("gpu-3", False)
            return (await asyncio.wait_for(pending, 20)).payload
        finally:
            await events.aclose()

    event = asyncio.run(first_event())

    assert event["status"] == "faulted", event
    assert event["fault"]["kind"] == "node_unresponsive"
    assert (event["fault"]["culprit_node"], event["fault"]["evidence"]["host"]) == (
        "pod-0", "gpu-3")


def test_taints_forbidden_by_rbac_leave_the_affinity_and_warn(
    fake: FakeApiServer, tmp_path: Path, node_pool: NodePool, caplog: pytest.LogCaptureFixture
) -> None:
    """taint_quarantine on without ClusterRole relay-node-tainter bound: a 403 must neither
    fail the launch nor the recording of a fault's decision."""
    launcher = make_launcher(fake, tmp_path, taint_quarantine=True)
    node_pool.quarantine("gpu-1", 60, reason="test", by="test")
    fake.forbid_node_patch = True

    with caplog.at_level("WARNING"):
        launcher.enforce_quarantines(node_pool.quarantines())

    assert "taints" not in fake.get("nodes", "gpu-1", None)["spec"]
    assert "relay-node-tainter" in caplog.text


def test_the_end_of_a_dag_run_lifts_the_taint_of_a_quarantine_that_ended(
    fake: FakeApiServer, tmp_path: Path, node_pool: NodePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kubernetes has no expiring taint: Relay lifts it, at a launch, a quarantine, and
    the end of every DAG run (finalize), so an idle Relay leaves no node NoSchedule long."""
    from relay import launchers
    from relay.core.settings import REPO_ROOT
    from relay.operators import base as operators
    from relay.spec.job import load_job_spec

    launcher = make_launcher(fake, tmp_path, taint_quarantine=True)
    node_pool.quarantine("gpu-1", 60, reason="test", by="test")
    launcher.enforce_quarantines(node_pool.quarantines())
    assert fake.get("nodes", "gpu-1", None)["spec"]["taints"]
    node_pool.release("gpu-1")  # ended (or released by hand) while nothing launched

    monkeypatch.setattr(launchers, "launcher_for", lambda spec: launcher)
    operators._end_run(load_job_spec(REPO_ROOT / "dags" / "jobs" / "demo.yaml"), "run-1")

    assert fake.get("nodes", "gpu-1", None)["spec"]["taints"] == []
