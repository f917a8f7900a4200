"""Kubernetes objects for one segment attempt, built as plain data (one function per object).

An attempt is an Indexed Job (one pod per node, each running the node agent
for its completion index), a headless Service whose DNS name gives the ranks a
rendezvous on the index-0 pod, a ConfigMap holding the launch file, and (in
``relay.launchers.k8s.access``) a Secret with what the launch file leaves out
and a NetworkPolicy. All but the Job are owned by the Job, so one foreground
delete of the Job removes everything. The pods meet Pod Security ``restricted``
(non-root, no privilege escalation, no capabilities, the runtime's seccomp
profile) and run on a read-only root file system: every place the agent and
its ranks write is a volume (:func:`_writable_volumes`). Nothing here talks to
a cluster: tests validate these dicts against the Kubernetes OpenAPI schema.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.core.attempt import Attempt
from relay.spec.sections import KubernetesSpec
from relay_train.protocol.env import (
    ENV_CHANNEL_SECRET,
    ENV_CHANNEL_TLS_CERT,
    ENV_CHANNEL_TLS_KEY,
    ENV_CHECKPOINT_KEYS_FILE,
    ENV_HOST,
    ENV_NODE_INDEX,
    ENV_PREEMPT_GRACE,
    ENV_TRACKING_URI,
)
from relay_train.protocol.launch import LAUNCH_FILE
from relay_train.protocol.routes import AGENT_PORT
from relay_train.protocol.signing import KEYRING_FILE

GROUP = "relay.dev"
LABEL_ATTEMPT = f"{GROUP}/attempt"  # the try's number
LABEL_ATTEMPT_ID = f"{GROUP}/attempt-id"
LABEL_SEGMENT_KEY = f"{GROUP}/segment-key"
ANNOTATION_NODES = f"{GROUP}/nodes"
ANNOTATION_LAUNCHED_AT = f"{GROUP}/launched-at"
QUARANTINE_TAINT_KEY = f"{GROUP}/quarantined"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
DISRUPTION_CONDITION = "DisruptionTarget"  # the pod condition of an eviction or preemption
LAUNCH_MOUNT = "/relay/launch"
POD_ATTEMPT_DIR = "/relay/attempt"
CHANNEL_TLS_MOUNT = "/relay/channel-tls"  # the agents' certificate and key (their TLS Secret)
RENDEZVOUS_PORT = 29500
AGENT_CONTAINER = "agent"
AGENT_LINGER_SECONDS = 10  # after its ranks end, the agent answers (exit codes, errors) this long
FINISHED_TTL_SECONDS = 3600  # Relay deletes Jobs itself; this only catches leftovers
WORKER_UID = 50000  # deploy/worker.Dockerfile's USER; runAsNonRoot is checked by UID
POD_HOME = "/relay/home"  # HOME: MLflow's ~/.config/mlflow, ~/.cache (torch hub, triton)
# The attempt's Secret (same name as its Job): key -> the env variable the pod reads it as.
SECRET_TRACKING_URI = "tracking-uri"
SECRET_CHANNEL = "channel-secret"
SECRET_ENV = {SECRET_TRACKING_URI: ENV_TRACKING_URI, SECRET_CHANNEL: ENV_CHANNEL_SECRET}
# The deployment's checkpoint key ring: a Secret the operator creates (key KEYRING_FILE),
# mounted read-only; the ranks sign and verify checkpoint manifests with it.
KEYS_SECRET = "relay-checkpoint-key"
KEYS_MOUNT = "/relay/keys"
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def safe_label(value: str) -> str:
    """Return ``value`` as a valid label value (<= 63 chars; a hash suffix when changed)."""
    if len(value) <= 63 and _LABEL_VALUE.match(value):
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    trimmed = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:54].strip("-_.")
    return f"{trimmed}-{digest}" if trimmed else digest


def _dns(value: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-") or "x"


@dataclass(frozen=True)
class AttemptKey:
    """Who an attempt belongs to, read from its folder ``<dag_id>/<run>/segment-NNN/try-N``."""

    dag_id: str
    dag_run: str
    segment: int
    attempt: int

    @classmethod
    def of(cls, attempt: Attempt) -> AttemptKey:
        """Return the key of the attempt whose workload runs in ``attempt.runs_in``."""
        return cls.from_dir(attempt.runs_in)

    @classmethod
    def from_dir(cls, root: Path) -> AttemptKey:
        """Parse an attempt folder; raise ValueError naming the expected layout."""
        parts = Path(root).parts[-4:]
        if len(parts) < 4 or not parts[2].startswith("segment-") or not parts[3].startswith(
            "try-"
        ):
            raise ValueError(f"{root}: expected an attempt folder .../<dag_id>/<run>/"
                             "segment-NNN/try-N")
        return cls(parts[0], parts[1], int(parts[2].removeprefix("segment-")),
                   int(parts[3].removeprefix("try-")))

    @property
    def segment_key(self) -> str:
        """Return a short stable digest of (DAG, run, segment): every attempt of it shares it."""
        raw = f"{self.dag_id}/{self.dag_run}/{self.segment}"
        return hashlib.sha256(raw.encode()).hexdigest()[:10]

    @property
    def name(self) -> str:
        """Return the Job's (and Service's, ConfigMap's) name: a DNS label, stable per attempt."""
        job = _dns(self.dag_id.removeprefix("relay_"))[:24].strip("-")
        return f"relay-{job}-{self.segment_key}-s{self.segment}-a{self.attempt}"

    def labels(self) -> dict[str, str]:
        """Return the labels every object of this attempt carries."""
        return {
            "app.kubernetes.io/name": "relay-worker",
            "app.kubernetes.io/managed-by": "relay",
            f"{GROUP}/dag-id": safe_label(self.dag_id),
            f"{GROUP}/dag-run": safe_label(self.dag_run),
            f"{GROUP}/segment": str(self.segment),
            LABEL_ATTEMPT: str(self.attempt),
            LABEL_SEGMENT_KEY: self.segment_key,
            LABEL_ATTEMPT_ID: self.name,
        }

    def selector(self) -> str:
        """Return the label selector of this attempt's pods."""
        return f"{LABEL_ATTEMPT_ID}={self.name}"


def master_addr(key: AttemptKey) -> str:
    """Return the index-0 pod's DNS name under the attempt's headless Service."""
    return f"{key.name}-0.{key.name}"


def agent_url(key: AttemptKey, namespace: str, index: int, *, tls: bool = False) -> str:
    """Return the channel address of the agent in pod ``index`` (its headless-Service name)."""
    scheme = "https" if tls else "http"
    return f"{scheme}://{key.name}-{index}.{key.name}.{namespace}.svc:{AGENT_PORT}"


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    """Return an owner reference to a created Job, so deleting it deletes the owned object."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"], "blockOwnerDeletion": True}


def object_metadata(key: AttemptKey, namespace: str, owner: dict[str, Any] | None = None,
                    annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """Return an attempt object's metadata: its name, namespace, labels and owner."""
    meta: dict[str, Any] = {"name": key.name, "namespace": namespace, "labels": key.labels()}
    if annotations:
        meta["annotations"] = annotations
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def _affinity(key: AttemptKey, quarantined: list[str]) -> dict[str, Any]:
    """No two pods of the attempt on one node; never a quarantined node."""
    spread = {"labelSelector": {"matchLabels": {LABEL_ATTEMPT_ID: key.name}},
              "topologyKey": "kubernetes.io/hostname"}
    affinity: dict[str, Any] = {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [spread]}}
    if quarantined:
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "NotIn", "values": sorted(quarantined)}]}]}}
    return affinity


def _writable_volumes() -> list[tuple[str, str, dict[str, Any]]]:
    """Return (name, mount path, emptyDir) for every place the agent and its ranks write:
    the root file system is read-only."""
    return [
        # Heartbeats, status, logs, flight-recorder dumps, rescued state, resume downloads,
        # and the checkpoints rank 0 stages before publishing them.
        ("attempt", POD_ATTEMPT_DIR, {}),
        # tempfile's default: MLflow's upload staging, torch's inductor cache
        # (/tmp/torchinductor_<user>, made at import), the publisher's temporary files.
        ("tmp", "/tmp", {}),  # noqa: S108 - an emptyDir of the pod's own
        ("home", POD_HOME, {}),
        ("dshm", "/dev/shm", {"medium": "Memory"}),  # torch's shared-memory tensors, gloo
    ]


def _mounts() -> list[dict[str, Any]]:
    """Return the container's volume mounts: the launch file and the checkpoint key ring
    read-only, the rest writable."""
    return [{"name": "launch", "mountPath": LAUNCH_MOUNT, "readOnly": True},
            {"name": "checkpoint-keys", "mountPath": KEYS_MOUNT, "readOnly": True}] + [
        {"name": name, "mountPath": path} for name, path, _ in _writable_volumes()]


def _volumes(key: AttemptKey) -> list[dict[str, Any]]:
    """Return the pod's volumes (see :func:`_mounts`)."""
    keys = {"secretName": KEYS_SECRET, "defaultMode": 0o440,  # readable by the pod's fsGroup
            "items": [{"key": KEYRING_FILE, "path": KEYRING_FILE}]}
    return [{"name": "launch", "configMap": {"name": key.name}},
            {"name": "checkpoint-keys", "secret": keys}] + [
        {"name": name, "emptyDir": empty} for name, _, empty in _writable_volumes()]


def _pod_security() -> dict[str, Any]:
    """Return the pod's securityContext: Pod Security ``restricted`` at the pod level."""
    return {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
            "fsGroup": WORKER_UID, "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> dict[str, Any]:
    """Return the container's securityContext: no privilege, no capability, read-only root."""
    return {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "privileged": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def _resources(k8s: KubernetesSpec) -> dict[str, Any]:
    """Return the container's requests and limits (equal: a Guaranteed pod)."""
    wanted = {"cpu": k8s.cpu, "memory": k8s.memory}
    if k8s.gpus_per_pod:
        wanted["nvidia.com/gpu"] = str(k8s.gpus_per_pod)
    return {"requests": dict(wanted), "limits": dict(wanted)}


def termination_grace(k8s: KubernetesSpec) -> int:
    """Return the pods' terminationGracePeriodSeconds (whole seconds, rounded up)."""
    return math.ceil(k8s.termination_grace)


def _secret_env(key: AttemptKey, secret_keys: list[str]) -> list[dict[str, Any]]:
    """Return the env variables read from the attempt's Secret (never a value in clear)."""
    return [{"name": SECRET_ENV[item], "valueFrom": {"secretKeyRef": {
        "name": key.name, "key": item}}} for item in sorted(secret_keys)]


def _container(k8s: KubernetesSpec, key: AttemptKey, secret_keys: list[str]) -> dict[str, Any]:
    env = [
        {"name": ENV_NODE_INDEX, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": ENV_HOST, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # An eviction's SIGTERM is a preemption notice: the agent's grace is the pod's.
        {"name": ENV_PREEMPT_GRACE, "value": str(termination_grace(k8s))},
        {"name": "MASTER_ADDR", "value": master_addr(key)},
        {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        {"name": "OMP_NUM_THREADS", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},  # the image is read-only
        {"name": "HOME", "value": POD_HOME},
        {"name": ENV_CHECKPOINT_KEYS_FILE, "value": f"{KEYS_MOUNT}/{KEYRING_FILE}"},
        *_secret_env(key, secret_keys),
    ]
    container: dict[str, Any] = {
        "name": AGENT_CONTAINER,
        "image": k8s.image,
        "command": ["python", "-m", "relay_train.agent.node"],
        "args": ["--launch", f"{LAUNCH_MOUNT}/{LAUNCH_FILE}",
                 "--node-index", f"$({ENV_NODE_INDEX})",
                 "--bind", "0.0.0.0", "--port", str(AGENT_PORT),  # noqa: S104 - the pod's IP
                 "--linger", str(AGENT_LINGER_SECONDS)],
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
                  {"name": "channel", "containerPort": AGENT_PORT}],
        "volumeMounts": _mounts(),
        "resources": _resources(k8s),
        "securityContext": _container_security(),
    }
    return container


def add_channel_tls(pod_spec: dict[str, Any], secret: str | None) -> dict[str, Any]:
    """Mount the agents' TLS Secret read-only into the agent container and name its files in
    the agent's environment (see relay_train.protocol.channel_tls); nothing when ``secret`` is
    None (clear text). Return ``pod_spec``."""
    if secret is None:
        return pod_spec
    pod_spec["volumes"].append({"name": "channel-tls", "secret": {
        "secretName": secret, "defaultMode": 0o440,  # readable by the pod's fsGroup
        "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}})
    container = next(c for c in pod_spec["containers"] if c["name"] == AGENT_CONTAINER)
    container["volumeMounts"].append(
        {"name": "channel-tls", "mountPath": CHANNEL_TLS_MOUNT, "readOnly": True})
    container["env"] += [
        {"name": ENV_CHANNEL_TLS_CERT, "value": f"{CHANNEL_TLS_MOUNT}/tls.crt"},
        {"name": ENV_CHANNEL_TLS_KEY, "value": f"{CHANNEL_TLS_MOUNT}/tls.key"}]
    return pod_spec


def job_manifest(key: AttemptKey, k8s: KubernetesSpec, nodes: list[str], ranks_per_node: int,
                 quarantined: list[str], launched_at: float,
                 secret_keys: list[str] | None = None) -> dict[str, Any]:
    """Return the attempt's Indexed Job: one pod per node, no retries by Kubernetes.

    ``secret_keys`` are the keys of the attempt's Secret (``SECRET_ENV``) the pods read as
    env variables; default: the tracking URI only."""
    keys = [SECRET_TRACKING_URI] if secret_keys is None else secret_keys
    count = len(nodes)
    annotations = {ANNOTATION_NODES: json.dumps(nodes), f"{GROUP}/ranks-per-node":
                   str(ranks_per_node), ANNOTATION_LAUNCHED_AT: repr(launched_at),
                   f"{GROUP}/dag-run": key.dag_run}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": key.name,  # with the headless Service: <job>-<index>.<job> resolves
        "serviceAccountName": k8s.service_account,
        "automountServiceAccountToken": False,  # the pods never call the API
        "terminationGracePeriodSeconds": termination_grace(k8s),
        "securityContext": _pod_security(),
        "affinity": _affinity(key, quarantined),
        "containers": [_container(k8s, key, keys)],
        "volumes": _volumes(key),
    }
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod_spec["tolerations"] = [t.manifest() for t in k8s.tolerations]
    add_channel_tls(pod_spec, k8s.channel_tls_secret)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_metadata(key, k8s.namespace, annotations=annotations),
        "spec": {
            "completionMode": "Indexed",
            "completions": count,
            "parallelism": count,
            "backoffLimit": 0,  # the recovery policy decides retries, not Kubernetes
            "podFailurePolicy": pod_failure_policy(),
            "activeDeadlineSeconds": max(1, int(k8s.active_deadline)),
            "ttlSecondsAfterFinished": FINISHED_TTL_SECONDS,
            "template": {"metadata": {"labels": key.labels()}, "spec": pod_spec},
        },
    }


def pod_failure_policy() -> dict[str, Any]:
    """Return the Job's podFailurePolicy: a disrupted pod (preempted, evicted, its node
    drained or tainted NoExecute: the pod condition DisruptionTarget) fails the Job at once
    (FailJob), named in the Job's condition; relay.launchers.k8s.status reads it as a
    preemption, not a crash. Not Ignore: the Job controller would start a replacement pod
    for that index behind Relay's back, into a world its peers have left. Every other
    failure counts against backoffLimit 0, as without a policy. Needs restartPolicy Never."""
    return {"rules": [{"action": "FailJob", "onPodConditions": [
        {"type": DISRUPTION_CONDITION, "status": "True"}]}]}


def service_manifest(key: AttemptKey, namespace: str, owner: dict[str, Any]) -> dict[str, Any]:
    """Return the headless Service that names each pod for the rendezvous."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(key, namespace, owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # ranks meet before any readiness exists
            "selector": {LABEL_ATTEMPT_ID: key.name},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT,
                       "targetPort": RENDEZVOUS_PORT},
                      {"name": "channel", "port": AGENT_PORT, "targetPort": AGENT_PORT}],
        },
    }


def configmap_manifest(key: AttemptKey, namespace: str, owner: dict[str, Any],
                       launch_json: str) -> dict[str, Any]:
    """Return the ConfigMap the pods read their launch file from (``launch_json`` without
    the tracking URI or any secret: see ``relay.launchers.k8s.access.split_launch``)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(key, namespace, owner),
        "data": {LAUNCH_FILE: launch_json},
    }


def quarantine_taint(until: float) -> dict[str, Any]:
    """Return the taint that keeps new pods off a quarantined node; its value is the expiry."""
    return {"key": QUARANTINE_TAINT_KEY, "value": str(int(until)), "effect": "NoSchedule"}
