"""Kubernetes: what Relay's pods may do, who may reach them, what Relay itself may do.

The rendered pods are checked against the rules of Pod Security ``restricted``
(written out below from the Pod Security Standards), the attempt's Secret and
NetworkPolicy are created through the real client against the fake API server
(tests/k8s_fake.py), the NetworkPolicies are evaluated for who gets in, and the
RBAC is checked for its namespaces and bindings, not only its verbs.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from k8s_fake import FakeApiServer
from kubernetes_validate.utils import resources_from_file

from relay.core.exceptions import ConfigError
from relay.launchers.k8s import launcher as launcher_module
from relay.launchers.k8s.access import network_policy_manifest, split_launch
from relay.launchers.k8s.launcher import KubernetesLauncher
from relay.launchers.k8s.objects import AttemptKey, job_manifest
from relay.spec.job import load_job_spec
from relay.spec.sections import KubernetesSpec
from relay_train.protocol.launch import LaunchConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEY = AttemptKey("relay_demo", "manual__2026-12-03T05_00_00_00_00", 3, 2)
IMAGE = "registry.example.com/relay-worker:0.1.0"
SETTINGS = {
    "cpu": KubernetesSpec(image=IMAGE),
    "gpu": KubernetesSpec(image=IMAGE, namespace="relay", gpus_per_pod=8, cpu=32,
                          memory="512Gi", taint_quarantine=True),
}
TRACKING_URI = "https://relay:tracking-password@mlflow.example.com"
CHANNEL_SECRET = "c2VjcmV0LWNoYW5uZWwta2V5"
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                   "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Return how a pod spec breaks Pod Security ``restricted`` (baseline's rules included),
    as the Pod Security Standards list them; empty when it meets the profile."""
    found: list[str] = []
    pod_sc = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            found.append(f"host namespaces: {flag}")
    if pod_sc.get("sysctls"):
        found.append("sysctls")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("hostProcess")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volume {volume['name']}: type {sorted(kinds - ALLOWED_VOLUMES)}")
    containers = pod["containers"] + pod.get("initContainers", []) + pod.get(
        "ephemeralContainers", [])
    for c in containers:
        sc = c.get("securityContext") or {}
        where = f"container {c['name']}"
        if sc.get("privileged"):
            found.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{where}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{where}: capabilities added")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            found.append(f"{where}: runAsNonRoot must be true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"{where}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost")
        for opts in (sc, pod_sc):
            selinux = opts.get("seLinuxOptions") or {}
            if selinux.get("user") or selinux.get("role") or selinux.get("type") not in (
                    None, "", "container_t", "container_init_t", "container_kvm_t"):
                found.append(f"{where}: seLinuxOptions")
            if (opts.get("appArmorProfile") or {}).get("type") == "Unconfined":
                found.append(f"{where}: AppArmor unconfined")
        if sc.get("procMount") not in (None, "Default"):
            found.append(f"{where}: procMount")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{where}: hostPort")
    return found


def pod_of(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_rendered_pods_meet_pod_security_restricted(name: str) -> None:
    job = job_manifest(KEY, SETTINGS[name], ["pod-0", "pod-1"], 8, ["gpu-node-3"], 1.7e9)
    assert restricted_violations(pod_of(job)) == []
    container = pod_of(job)["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod_of(job)["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_profile_check_catches_what_restricted_forbids() -> None:
    """Each rule can fail: take the rendered pod and break one thing at a time."""
    breaks = {
        "root": lambda p: p["securityContext"].update(runAsNonRoot=False, runAsUser=0),
        "escalation": lambda p: p["containers"][0]["securityContext"].update(
            allowPrivilegeEscalation=True),
        "caps": lambda p: p["containers"][0]["securityContext"].update(
            capabilities={"add": ["SYS_ADMIN"]}),
        "seccomp": lambda p: (p["securityContext"].pop("seccompProfile"),
                              p["containers"][0]["securityContext"].pop("seccompProfile")),
        "hostPath": lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "hostNetwork": lambda p: p.update(hostNetwork=True),
        "privileged": lambda p: p["containers"][0]["securityContext"].update(privileged=True),
    }
    for what, breaking in breaks.items():
        pod = pod_of(job_manifest(KEY, SETTINGS["cpu"], ["pod-0"], 1, [], 0.0))
        breaking(pod)
        assert restricted_violations(pod), f"{what}: not caught"


def test_resources_come_from_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_POLICIES_DIR", str(tmp_path))
    (tmp_path / "default.yaml").write_text("version: 1\n")
    text = textwrap.dedent(f"""\
        job: demo
        total_steps: 240
        steps_per_segment: 60
        checkpoint_every: 20
        launcher: kubernetes
        kubernetes: {{image: {IMAGE}, cpu: 6, memory: 48Gi, gpus_per_pod: 2}}
        """)
    (tmp_path / "k8s.yaml").write_text(text)
    spec = load_job_spec(tmp_path / "k8s.yaml")
    job = job_manifest(KEY, spec.kubernetes, ["pod-0"], 2, [], 0.0)  # type: ignore[arg-type]
    want = {"cpu": "6", "memory": "48Gi", "nvidia.com/gpu": "2"}
    assert pod_of(job)["containers"][0]["resources"] == {"requests": want, "limits": want}

    (tmp_path / "bad.yaml").write_text(text.replace("memory: 48Gi", "memory: lots"))
    with pytest.raises(ConfigError) as bad:
        load_job_spec(tmp_path / "bad.yaml")
    [problem] = [p for p in bad.value.problems if p.field == "kubernetes.memory"]
    assert "memory: 64Gi" in problem.fix and problem.line == 6


def test_the_namespace_enforces_restricted() -> None:
    [namespace] = resources_from_file(str(DEPLOY / "namespace.yaml"))
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
    # ... so whatever deploy/ puts there must meet it too.
    templates = [d["spec"]["template"]["spec"] for p in sorted(DEPLOY.glob("*.yaml"))
                 if p.name != "airflow-values.yaml" for d in resources_from_file(str(p))
                 if d["metadata"].get("namespace") == namespace["metadata"]["name"]
                 and "template" in d.get("spec", {})]
    assert templates, "no pod template in deploy/ runs in the namespace"
    for template in templates:
        assert restricted_violations(template) == [], template["containers"][0]["name"]


# -- the Secret ----------------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    for host in ("gpu-1", "gpu-2"):
        server.add_node(host)
    yield server
    server.stop()


def launch_with_secrets(fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        **settings: Any) -> str:  # noqa: ANN401
    """Launch an attempt whose launch data carries a tracking URI with a password and a
    ``channel_secret`` (the field another branch adds; here added to the launch data)."""
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", "gpu-1,gpu-2")
    monkeypatch.setattr(launcher_module, "asdict", lambda cfg: {
        **dataclasses.asdict(cfg), "channel_secret": CHANNEL_SECRET})
    hook = KubernetesHook(conn_id=None, kubernetes_conn_id=None,
                          config_file=str(fake.kubeconfig(tmp_path / "kubeconfig")))
    # TLS has its own tests (test_k8s_channel_tls.py): clear text here
    settings = {"channel_tls_secret": None, "channel_ca_secret": None, **settings}
    launcher = KubernetesLauncher(KubernetesSpec(image=IMAGE, **settings), hook=hook,
                                  retry_wait_seconds=0)
    root = tmp_path / "runs" / "relay_k8sdemo" / "manual__1" / "segment-001" / "try-0"
    cfg = LaunchConfig(
        job="k8sdemo", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=60,
        checkpoint_every=20, nodes=launcher.slots(["gpu-1", "gpu-2"]), ranks_per_node=2,
        tracking_uri=TRACKING_URI, run_id="abc", attempt_dir=str(root), attempt=0, segment=1)
    launcher.launch(cfg)
    return AttemptKey.from_dir(root).name


def test_the_tracking_uri_and_channel_secret_travel_only_in_the_attempts_secret(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = launch_with_secrets(fake, tmp_path, monkeypatch)

    job, secret = fake.get("jobs", name), fake.get("secrets", name)
    assert secret is not None, "no Secret created"
    assert secret["metadata"]["ownerReferences"] == [{
        "apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"],
        "blockOwnerDeletion": True}]
    stored = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert stored == {"tracking-uri": TRACKING_URI, "channel-secret": CHANNEL_SECRET}
    for res in ("configmaps", "jobs", "services", "networkpolicies"):
        for obj in fake.items(res):
            text = json.dumps(obj)
            assert TRACKING_URI not in text and "tracking-password" not in text, res
            assert CHANNEL_SECRET not in text, res
    env = {e["name"]: e for e in pod_of(job)["containers"][0]["env"]}
    assert env["RELAY_MLFLOW_TRACKING_URI"]["valueFrom"] == {
        "secretKeyRef": {"name": name, "key": "tracking-uri"}}
    assert env["RELAY_CHANNEL_SECRET"]["valueFrom"] == {
        "secretKeyRef": {"name": name, "key": "channel-secret"}}
    launch = json.loads(fake.get("configmaps", name)["data"]["launch.json"])
    assert launch["tracking_uri"] == "" and launch["channel_secret"] == ""

    fake.delete("jobs", "default", name, "Foreground", None)  # garbage-collected with its Job
    assert fake.get("secrets", name) is None and fake.get("networkpolicies", name) is None


def test_a_pod_reads_the_tracking_uri_the_configmap_leaves_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = LaunchConfig(
        job="k8sdemo", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=60,
        checkpoint_every=20, nodes=["pod-0"], ranks_per_node=1, tracking_uri=TRACKING_URI,
        run_id="abc", attempt_dir=str(tmp_path), attempt=0, segment=1)
    public, secret = split_launch(dataclasses.asdict(cfg))
    assert secret == {"tracking-uri": TRACKING_URI} and public["tracking_uri"] == ""
    (tmp_path / "launch.json").write_text(json.dumps(public))
    monkeypatch.setenv("RELAY_MLFLOW_TRACKING_URI", secret["tracking-uri"])  # secretKeyRef

    assert LaunchConfig.read(tmp_path / "launch.json").tracking_uri == TRACKING_URI
    monkeypatch.delenv("RELAY_MLFLOW_TRACKING_URI")
    cfg.write(tmp_path / "local.json")  # a local launch keeps the URI in its 0600 file
    assert LaunchConfig.read(tmp_path / "local.json").tracking_uri == TRACKING_URI


# -- the NetworkPolicies -------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Return whether a label selector (matchLabels, matchExpressions In) selects labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def admitted(policies: list[dict[str, Any]], target: dict[str, str], namespace: str,
             source: dict[str, str], source_ns: str, port: int) -> bool:
    """Return whether TCP from a source pod to ``port`` of a target pod is admitted, as a
    network plugin applies Ingress NetworkPolicies (isolated once any policy selects it)."""
    ns_labels = {"kubernetes.io/metadata.name": source_ns}
    selecting = [p for p in policies if p["metadata"]["namespace"] == namespace
                 and _selects(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p["port"] == port for p in ports):
                continue
            for peer in rule.get("from") or []:
                if "namespaceSelector" in peer:
                    ns_ok = _selects(peer["namespaceSelector"], ns_labels)
                else:
                    ns_ok = source_ns == namespace
                if ns_ok and _selects(peer.get("podSelector") or {}, source):
                    return True
    return False


def test_only_airflow_reaches_the_agents_and_only_the_attempt_reaches_its_ranks() -> None:
    settings = KubernetesSpec(image=IMAGE, namespace="relay")
    other = AttemptKey("relay_demo", "manual__2026-12-03T05_00_00_00_00", 3, 3)
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": KEY.name, "uid": "u"}
    policies = [*resources_from_file(str(DEPLOY / "networkpolicy.yaml")),
                network_policy_manifest(KEY, settings, owner),
                network_policy_manifest(other, settings, owner)]
    for policy in policies[1:]:
        kubernetes_validate.validate(policy, "1.37", strict=True)
    job = job_manifest(KEY, settings, ["pod-0"], 1, [], 0.0)
    pod, target = pod_of(job), job["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    own = KEY.labels()
    worker, triggerer = {"component": "worker"}, {"component": "triggerer"}

    def reach(source: dict[str, str], ns: str, port: int, to: dict[str, str] = target) -> bool:
        return admitted(policies, to, "relay", source, ns, port)

    assert reach(worker, "airflow", ports["channel"]) and reach(triggerer, "airflow", 29401)
    assert not reach(worker, "airflow", ports["rendezvous"])
    assert not reach({"component": "webserver"}, "airflow", ports["channel"])
    assert not reach(worker, "dag-authors", ports["channel"])  # the label, not the name
    assert reach(own, "relay", ports["rendezvous"]) and reach(own, "relay", 41234)  # gloo
    assert not reach(other.labels(), "relay", ports["rendezvous"])
    assert not reach(other.labels(), "relay", ports["channel"])
    assert not reach({"app": "anything"}, "relay", ports["rendezvous"])
    leftover = {**own, "relay.dev/attempt-id": "relay-gone-0000000000-s1-a0"}
    assert not reach(own, "relay", ports["rendezvous"], to=leftover)  # no attempt policy
    airflow_elsewhere = network_policy_manifest(
        KEY, KubernetesSpec(image=IMAGE, namespace="relay", airflow_namespace="orchestration"),
        owner)
    assert admitted([airflow_elsewhere], target, "relay", worker, "orchestration", 29401)


# -- RBAC: namespaces and bindings ---------------------------------------------------


def rbac_docs(*names: str) -> dict[tuple[str, str | None, str], dict[str, Any]]:
    """Return the RBAC objects of deploy/ files by (kind, namespace, name)."""
    return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
            for n in names for d in resources_from_file(str(DEPLOY / n))}


AIRFLOW = {("ServiceAccount", "airflow-worker", "airflow"),
           ("ServiceAccount", "airflow-triggerer", "airflow")}


def grants(doc: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in doc["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


def test_rbac_grants_each_thing_in_its_namespace_to_airflow_only() -> None:
    docs = rbac_docs("rbac.yaml")
    kinds = {k for k, _, _ in docs}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                     "ClusterRoleBinding"}
    roles = {key: d for key, d in docs.items() if key[0] in ("Role", "ClusterRole")}
    for (_, _, name), role in roles.items():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], name
    # Namespaced grants: jobs, pods, services, configmaps, secrets, policies in relay only;
    # kubelet leases (read) in kube-node-lease only.
    assert grants(docs[("Role", "relay", "relay-launcher")]) >= {
        ("", "secrets", "create"), ("networking.k8s.io", "networkpolicies", "create"),
        ("batch", "jobs", "create")}
    assert grants(docs[("Role", "kube-node-lease", "relay-node-lease-reader")]) == {
        ("coordination.k8s.io", "leases", "get")}
    # Cluster-wide: reading nodes only; no secrets, jobs or pods anywhere else.
    [cluster_role] = [d for (k, _, _), d in roles.items() if k == "ClusterRole"]
    assert grants(cluster_role) == {("", "nodes", "get"), ("", "nodes", "list")}
    # Every binding: its role exists in its own namespace, its subjects are Airflow's.
    bindings = {key: d for key, d in docs.items() if key[0].endswith("Binding")}
    assert len(bindings) == 3
    for (kind, ns, name), binding in bindings.items():
        ref = binding["roleRef"]
        role_kind = "Role" if kind == "RoleBinding" else "ClusterRole"
        assert ref["kind"] == role_kind, name  # a RoleBinding never lends a ClusterRole here
        assert (role_kind, ns, ref["name"]) in roles, f"{name}: binds a missing role"
        subjects = {(s["kind"], s["name"], s["namespace"]) for s in binding["subjects"]}
        assert subjects == AIRFLOW, name
    worker_sa = docs[("ServiceAccount", "relay", "relay-worker")]
    assert worker_sa["automountServiceAccountToken"] is False
    assert not any(s["name"] == "relay-worker" for b in bindings.values()
                   for s in b["subjects"]), "the pods' account is bound to something"


def test_patching_nodes_is_granted_only_by_the_taint_quarantine_file() -> None:
    base = rbac_docs("rbac.yaml")
    assert not any(("", "nodes", "patch") in grants(d) for d in base.values() if "rules" in d)
    extra = rbac_docs("rbac-taint-quarantine.yaml")
    assert set(extra) == {("ClusterRole", None, "relay-node-tainter"),
                          ("ClusterRoleBinding", None, "relay-node-tainter")}
    assert grants(extra[("ClusterRole", None, "relay-node-tainter")]) == {
        ("", "nodes", "patch")}
    binding = extra[("ClusterRoleBinding", None, "relay-node-tainter")]
    assert binding["roleRef"]["name"] == "relay-node-tainter"
    assert [(s["name"], s["namespace"]) for s in binding["subjects"]] == [
        ("airflow-worker", "airflow")]


def test_without_taint_quarantine_the_launcher_never_patches_nodes(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.nodes.pool import NodePool

    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", "gpu-1,gpu-2")
    NodePool().quarantine("gpu-2", 600, reason="test", by="test")
    launch_with_secrets(fake, tmp_path, monkeypatch)
    base = rbac_docs("rbac.yaml")
    granted = set().union(*(grants(d) for d in base.values() if "rules" in d))
    assert fake.verbs <= granted, sorted(fake.verbs - granted)
    assert ("", "secrets", "create") in fake.verbs
