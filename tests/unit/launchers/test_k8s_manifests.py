"""Every Kubernetes manifest Relay generates or ships validates against the API's schema.

Strict validation (unknown fields are errors) with kubernetes-validate against the
OpenAPI schema of Kubernetes 1.37, the newest release it knows. No cluster needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import resources_from_file

from relay.launchers.k8s.objects import (
    AttemptKey,
    configmap_manifest,
    job_manifest,
    owner_reference,
    quarantine_taint,
    service_manifest,
)
from relay.spec.sections import MIN_TERMINATION_GRACE_SECONDS, KubernetesSpec
from relay_train.agent.notice import STOP_MARGIN_SECONDS
from relay_train.protocol.env import ENV_PREEMPT_GRACE

SCHEMA = "1.37"
DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
KEY = AttemptKey("relay_demo", "manual__2026-12-03T05_00_00_00_00", 3, 2)


def validate(manifest: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(manifest, SCHEMA, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{manifest['kind']} {manifest['metadata'].get('name')}: {exc.message} "
                    f"at {list(exc.absolute_path)}")


def created(manifest: dict[str, Any]) -> dict[str, Any]:
    """Return the manifest as the API server would return it (a uid filled in)."""
    return {**manifest, "metadata": {**manifest["metadata"], "uid": "1f0c-uid"}}


SETTINGS = [
    KubernetesSpec(image="registry.example.com/relay-worker:0.1.0"),
    KubernetesSpec(image="registry.example.com/relay-worker:0.1.0", namespace="relay",
                   gpus_per_pod=8, active_deadline=90, taint_quarantine=True,
                   service_account="trainer",
                   node_selector={"cloud.google.com/gke-nodepool": "a100", "pool": "train"},
                   tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists",
                                 "effect": "NoSchedule"},
                                {"key": "spot", "value": "true", "effect": "NoExecute",
                                 "toleration_seconds": 30}]),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["cpu", "gpu"])
@pytest.mark.parametrize("quarantined", [[], ["gpu-node-3", "gpu-node-1"]], ids=["open", "held"])
def test_attempt_objects_validate(settings: KubernetesSpec, quarantined: list[str]) -> None:
    job = job_manifest(KEY, settings, ["pod-0", "pod-1", "pod-2"], 8, quarantined, 1.7e9)
    owner = owner_reference(created(job))

    for manifest in (job, service_manifest(KEY, settings.namespace, owner),
                     configmap_manifest(KEY, settings.namespace, owner, "{}")):
        validate(manifest)


def test_job_shape_follows_the_settings() -> None:
    job = job_manifest(KEY, SETTINGS[1], ["pod-0", "pod-1"], 8, ["gpu-node-3"], 1.7e9)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]

    assert job["spec"]["activeDeadlineSeconds"] == 90
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "2",
                                                 "memory": "8Gi"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert pod["serviceAccountName"] == "trainer" and pod["automountServiceAccountToken"] is False
    assert container["args"][2:4] == ["--node-index", "$(RELAY_NODE_INDEX)"]
    assert container["args"][4:8] == ["--bind", "0.0.0.0", "--port", "29401"]  # the channel
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert "nvidia.com/gpu" not in job_manifest(KEY, SETTINGS[0], ["pod-0"], 1, [], 0.0)[
        "spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nodeAffinity" not in job_manifest(KEY, SETTINGS[0], ["pod-0"], 1, [], 0.0)["spec"][
        "template"]["spec"]["affinity"]


def test_the_pods_go_where_the_spec_says_and_tolerate_its_taints() -> None:
    pod = job_manifest(KEY, SETTINGS[1], ["pod-0"], 8, [], 1.7e9)["spec"]["template"]["spec"]

    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "a100", "pool": "train"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
         "tolerationSeconds": 30}]
    plain = job_manifest(KEY, SETTINGS[0], ["pod-0"], 1, [], 0.0)["spec"]["template"]["spec"]
    assert "nodeSelector" not in plain and "tolerations" not in plain


@pytest.mark.parametrize(("grace", "seconds"), [(None, 30), (45.5, 46)])
def test_the_pods_grace_is_the_spec_s_and_the_agent_knows_it(grace: float | None,
                                                            seconds: int) -> None:
    # The agent reads a SIGTERM's grace from its environment (relay_train.agent.notice): it
    # must be the pod's, or it drains past the kubelet's SIGKILL (or stops needlessly early).
    settings = SETTINGS[0] if grace is None else SETTINGS[0].model_copy(
        update={"termination_grace": grace})
    pod = job_manifest(KEY, settings, ["pod-0"], 1, [], 0.0)["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}

    assert pod["terminationGracePeriodSeconds"] == seconds
    assert env[ENV_PREEMPT_GRACE] == str(seconds)


def test_the_shortest_grace_leaves_a_notice_time_to_drain() -> None:
    assert MIN_TERMINATION_GRACE_SECONDS - STOP_MARGIN_SECONDS >= 4.0


def test_a_disrupted_pod_fails_the_job_at_once_and_nothing_else_is_retried() -> None:
    """Job API rules (kubernetes.io/docs/tasks/job/pod-failure-policy): podFailurePolicy
    needs restartPolicy Never; FailJob ends the Job at the first matching pod, which
    backoffLimit 0 alone would not tell from a crash."""
    spec = job_manifest(KEY, SETTINGS[0], ["pod-0", "pod-1"], 1, [], 0.0)["spec"]

    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == 0
    assert spec["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onPodConditions": [
        {"type": "DisruptionTarget", "status": "True"}]}]}


def test_quarantine_taint_validates_on_a_node() -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-3"},
            "spec": {"taints": [quarantine_taint(1_790_000_000.7)]}}
    validate(node)
    assert node["spec"]["taints"][0]["value"] == "1790000000"


MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "airflow-values.yaml")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_shipped_manifests_validate(path: Path) -> None:
    resources = resources_from_file(str(path))
    assert resources, f"{path}: no resources"
    for resource in resources:
        validate(resource)


def test_rbac_grants_only_what_the_launcher_uses() -> None:
    """Verbs only, both files together; namespaces and bindings: tests/security."""
    granted: dict[tuple[str, str], set[str]] = {}
    docs = [*resources_from_file(str(DEPLOY / "rbac.yaml")),
            *resources_from_file(str(DEPLOY / "rbac-taint-quarantine.yaml"))]
    for doc in docs:
        for rule in doc.get("rules", []) if doc["kind"] in ("Role", "ClusterRole") else []:
            for resource in rule["resources"]:
                granted.setdefault((rule["apiGroups"][0], resource), set()).update(rule["verbs"])

    assert granted == {
        ("batch", "jobs"): {"create", "get", "list", "delete"},
        ("batch", "jobs/finalizers"): {"update"},
        ("", "pods"): {"list", "watch", "delete"},
        ("", "services"): {"create"},
        ("", "configmaps"): {"create"},
        ("", "secrets"): {"create", "get"},  # get: the channel CA only
        ("networking.k8s.io", "networkpolicies"): {"create"},
        ("", "nodes"): {"get", "list", "patch"},
        ("coordination.k8s.io", "leases"): {"get"},
    }


def test_the_worker_image_lays_out_the_package_its_pod_command_imports(tmp_path: Path) -> None:
    """No Docker engine here: lay the image's files out as worker.Dockerfile's WORKDIR,
    PYTHONPATH and COPY lines say, then ask a bare interpreter (no site-packages, so not
    this checkout's editable install) where `python -m relay_train.agent.node` would come from."""
    import re
    import shutil
    import subprocess
    import sys

    from relay.core.settings import REPO_ROOT

    text = (REPO_ROOT / "deploy" / "worker.Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR\s+(\S+)", text, re.M).group(1)  # type: ignore[union-attr]
    pythonpath = re.search(r"PYTHONPATH=(\S+)", text).group(1)  # type: ignore[union-attr]
    image = tmp_path / "image"
    for source, dest in re.findall(r"^COPY\s+(?!--)(\S+)\s+(\S+)", text, re.M):
        target = image / (dest if dest.startswith("/") else f"{workdir}/{dest}").lstrip("/")
        shutil.copytree(REPO_ROOT / source, target)
    found = subprocess.run(
        [sys.executable, "-S", "-c", "import importlib.util as u; "
         "s = u.find_spec('relay_train.agent.node'); print(s.origin if s else '')"],
        env={"PYTHONPATH": str(image / pythonpath.lstrip("/"))}, capture_output=True,
        text=True, check=False, cwd=tmp_path)
    assert found.stdout.strip() == str(image / "opt/relay/relay_train/agent/node.py"), found.stderr
