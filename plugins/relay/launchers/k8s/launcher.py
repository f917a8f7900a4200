"""Run a segment attempt as a Kubernetes Indexed Job (objects: objects, access; state: status;
the API clients and their retries: clients; the cluster's nodes: cluster_nodes).

The API is reached through the cncf.kubernetes provider's ``KubernetesHook``
(its connection, kubeconfig or in-cluster credentials) and the official
``kubernetes`` client; calls are retried by tenacity on transient errors only
(429, 5xx, a dropped connection), never on 404 or 409, which mean something:

- 409 on create: the Job exists. A retried call whose first reply was lost
  re-attaches to it; a Job of the same name still being deleted is waited for.
- 404 on read: the attempt is gone (FAILED); on delete: already stopped.

A node is ``unresponsive`` when Kubernetes says its node is NotReady, when its
kubelet stops renewing its Lease (judged on Relay's clock, so node clock skew
does not matter), or when its pod stays Terminating past its grace period: a
fault within seconds, not after the 5-minute eviction timeout.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from relay.core.attempt import Attempt, AttemptState
from relay.launchers import launch_record
from relay.launchers.agent_client import AgentChannel
from relay.launchers.base import LaunchStatus, overall_state
from relay.launchers.k8s.access import network_policy_manifest, secret_manifest, split_launch
from relay.launchers.k8s.cluster_nodes import (
    LEASE_STALE_SECONDS,
    NODE_CHECK_SECONDS,
    KubernetesNodes,
)
from relay.launchers.k8s.objects import (
    ANNOTATION_LAUNCHED_AT,
    ANNOTATION_NODES,
    LABEL_ATTEMPT,
    LABEL_SEGMENT_KEY,
    POD_ATTEMPT_DIR,
    RENDEZVOUS_PORT,
    AttemptKey,
    agent_url,
    configmap_manifest,
    job_manifest,
    master_addr,
    owner_reference,
    service_manifest,
    termination_grace,
)
from relay.launchers.k8s.status import (
    job_failure,
    merge_agent_report,
    newest_by_index,
    slot_status,
    stuck,
)
from relay.spec.sections import KubernetesSpec
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.routes import SETTLED, NodeState

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook


log = logging.getLogger(__name__)

DELETION_WAIT_SECONDS = 30.0  # for a same-named Job still being deleted before a create


class KubernetesLauncher(KubernetesNodes):
    """Start, watch and stop segment attempts as Indexed Jobs."""

    name = "kubernetes"
    continuity = None  # pods do not outlive an attempt: every attempt launches afresh

    def __init__(self, settings: KubernetesSpec, hook: KubernetesHook | None = None,
                 conn_id: str | None = None, retry_wait_seconds: float = 0.5,
                 api_attempts: int = 4) -> None:
        self.settings = settings
        self._hook = hook
        self.conn_id = conn_id
        self.retry_wait_seconds = retry_wait_seconds
        self.api_attempts = api_attempts
        self.lease_stale_seconds = LEASE_STALE_SECONDS
        self.node_check_seconds = NODE_CHECK_SECONDS
        self._checked: dict[str, tuple[float, str | None]] = {}  # host -> (when, problem)
        self._leases: dict[str, tuple[Any, float]] = {}  # host -> (renewTime, first seen)
        self._launched_at: dict[str, float] = {}  # Job name -> its launch time
        self._channels: dict[str, AgentChannel] = {}  # Job name -> its agents' channel

    # -- the Launcher protocol -------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """Return the factory's description of this launcher."""
        return {"kind": self.name, "conn_id": self.conn_id, **self.settings.model_dump()}

    def slots(self, nodes: list[str]) -> list[str]:
        """Return one slot per node: Kubernetes picks the machines, Relay only counts them."""
        return [f"pod-{i}" for i in range(len(nodes))]

    def launch(self, cfg: LaunchConfig) -> Attempt:
        """Create the attempt's Job, ConfigMap and Service (idempotently); the ranks meet at
        pod 0 under the attempt's headless Service. Return the attempt."""
        from relay.nodes.pool import NodePool

        key = AttemptKey.from_dir(cfg.root)
        cfg = replace(cfg, channel_secret=new_secret())  # fresh for every attempt
        cfg.root.mkdir(parents=True, exist_ok=True)
        cfg.write(cfg.root / LAUNCH_FILE)  # for this worker's reports; the record travels
        pod_cfg = replace(cfg, attempt_dir=POD_ATTEMPT_DIR, master_addr=master_addr(key),
                          master_port=RENDEZVOUS_PORT, attempt_id=attempt_id_of(cfg.root),
                          checkpoint_keys={},  # not in a ConfigMap: the pods mount KEYS_SECRET
                          logs_to_mlflow=True)  # the pod's disk goes with it
        _ = self.channel_tls  # no CA Secret, no pods: Relay could not talk to them
        held = NodePool().quarantines()
        self.enforce_quarantines(held)
        public, secret = split_launch(asdict(pod_cfg))
        job = self._create_job(job_manifest(key, self.settings, cfg.nodes, cfg.ranks_per_node,
                                            sorted(held), time.time(), sorted(secret)))
        self._create_owned_objects(key, owner_reference(job), public, secret)
        log.info("Job %s/%s: %d pods, quarantined nodes excluded: %s", self.namespace, key.name,
                 len(cfg.nodes), ", ".join(sorted(held)) or "none")
        return Attempt(cfg.root, nodes=tuple(cfg.nodes))

    def _create_owned_objects(self, key: AttemptKey, owner: dict[str, Any],
                              public: dict[str, Any], secret: dict[str, str]) -> None:
        """Create what the Job owns: the Secret and the NetworkPolicy before the pods need
        them (they wait for the Secret; the policy lets the channel in), then the rest."""
        launch_json = json.dumps(public, indent=2, sort_keys=True)
        self._create_owned(self.core.create_namespaced_secret,
                           secret_manifest(key, self.namespace, owner, secret))
        self._create_owned(self.networking.create_namespaced_network_policy,
                           network_policy_manifest(key, self.settings, owner))
        self._create_owned(self.core.create_namespaced_config_map,
                           configmap_manifest(key, self.namespace, owner, launch_json))
        self._create_owned(self.core.create_namespaced_service,
                           service_manifest(key, self.namespace, owner))

    def handle(self, attempt: Attempt) -> dict[str, Any]:
        """Return nothing: the Job's name comes from the attempt folder's name, and its
        annotations (nodes, launch time) are in the API server for any worker to read."""
        return {}

    def attach(self, attempt: Attempt, handle: dict[str, Any]) -> None:
        """Do nothing: see :meth:`handle`."""

    def _create_job(self, manifest: dict[str, Any]) -> dict[str, Any]:
        name = manifest["metadata"]["name"]
        deadline = time.monotonic() + DELETION_WAIT_SECONDS
        while True:
            try:
                return self._as_dict(self._call(self.batch.create_namespaced_job,
                                                 self.namespace, manifest))
            except ApiException as exc:
                if exc.status != 409:
                    raise
            found = self._job_named(name)
            if found is None:
                continue  # deleted between our create and our read: create again
            existing = self._as_dict(found)
            if not existing["metadata"].get("deletionTimestamp"):
                log.info("Job %s already exists (uid %s): re-attaching to it", name,
                         existing["metadata"]["uid"])
                return existing
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"Job {self.namespace}/{name}: expected the earlier Job of this name to be "
                    f"deleted within {DELETION_WAIT_SECONDS:g}s, found it still terminating. "
                    "Check its pods (kubectl get pods -l relay.dev/attempt-id=" + name + ")."
                )
            time.sleep(0.5)

    def _create_owned(self, create: Callable[..., Any], manifest: dict[str, Any]) -> None:
        try:
            self._call(create, self.namespace, manifest)
        except ApiException as exc:
            if exc.status != 409:
                raise
            log.info("%s %s already exists: keeping it", manifest["kind"],
                     manifest["metadata"]["name"])

    def _job(self, key: AttemptKey) -> Any | None:  # noqa: ANN401 - V1Job
        return self._job_named(key.name)

    def _job_named(self, name: str) -> Any | None:  # noqa: ANN401 - V1Job
        try:
            return self._call(self.batch.read_namespaced_job, name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _pods(self, selector: str) -> list[Any]:
        return self._call(self.core.list_namespaced_pod, self.namespace,
                          label_selector=selector).items

    def started_at(self, attempt: Attempt) -> float:
        """Return when Relay launched the attempt (its Job's annotation; read once)."""
        name = AttemptKey.of(attempt).name
        if name not in self._launched_at:
            job = self._job_named(name)
            if job is None:
                raise KeyError(f"no Job for {attempt}")
            self._launched_at[name] = float(job.metadata.annotations[ANNOTATION_LAUNCHED_AT])
        return self._launched_at[name]

    def status(self, attempt: Attempt) -> LaunchStatus:
        """Read the Job, its pods and their nodes; say what each node slot is doing."""
        key = AttemptKey.of(attempt)
        job = self._job(key)
        if job is None:
            log.warning("Job %s/%s not found: the attempt is gone", self.namespace, key.name)
            return LaunchStatus(AttemptState.FAILED, {})
        slots = json.loads(job.metadata.annotations[ANNOTATION_NODES])
        pods = newest_by_index(self._pods(key.selector()))
        problems = {h: self._node_problem(h) for h in {p.spec.node_name for p in pods.values()
                                                       if p.spec and p.spec.node_name}}
        now = time.time()
        nodes = {slot: slot_status(slot, pods.get(i), problems, now)
                 for i, slot in enumerate(slots)}
        channel = self.channel(attempt, slots)
        channel.poll([s for s, n in nodes.items() if n.state == NodeState.RUNNING])
        channel.keep_node_records(attempt.runs_in)  # the pods wrote theirs on their own disk
        for slot, node in nodes.items():
            merge_agent_report(node, channel.reports.get(slot))
        failure = job_failure(job)
        if failure:
            for node in nodes.values():
                if node.state not in SETTLED:
                    node.state, node.detail = NodeState.FAILED, failure
        return LaunchStatus(overall_state(nodes), nodes, dict(channel.beats),
                            list(channel.refused), set(channel.crossed))

    def agent_url(self, key: AttemptKey, index: int) -> str:
        """Return where the agent of pod ``index`` answers (its headless-Service DNS name)."""
        tls = self.settings.channel_tls_secret is not None
        return agent_url(key, self.namespace, index, tls=tls)

    def channel(self, attempt: Attempt, slots: list[str] | None = None) -> AgentChannel:
        """Return the channel to the attempt's pod agents (slots from its Job, read once)."""
        key = AttemptKey.of(attempt)
        if key.name not in self._channels:
            if slots is None:
                job = self._job(key)
                slots = [] if job is None else json.loads(
                    job.metadata.annotations[ANNOTATION_NODES])
            self._channels[key.name] = AgentChannel(
                attempt_id_of(attempt.runs_in),
                {s: self.agent_url(key, i) for i, s in enumerate(slots)},
                self.channel_secret(attempt), tls=self.channel_tls)
        return self._channels[key.name]

    def channel_secret(self, attempt: Attempt) -> str:
        """Return the channel secret the attempt's pods got: from its launch record restored
        in this process (unsealed with the deployment's key ring), else the launch file this
        launcher wrote (0600); "" when there is neither (every agent refuses). The pods read
        it from the attempt's Secret, which Relay never reads back."""
        try:
            return launch_record.config_of(attempt.runs_in).channel_secret
        except (OSError, ValueError, TypeError) as exc:
            log.error("No channel secret for %s: expected its launch record or %s, found "
                      "neither (%s); its agents will refuse this worker", attempt.runs_in.name,
                      attempt.runs_in / LAUNCH_FILE, exc)
            return ""

    def host_of(self, attempt: Attempt, node: str) -> str:
        """Return the Kubernetes node the slot's pod runs on (the slot itself if unknown)."""
        key = AttemptKey.of(attempt)
        job = self._job(key)
        if job is None:
            return node
        slots = json.loads(job.metadata.annotations[ANNOTATION_NODES])
        pod = newest_by_index(self._pods(key.selector())).get(
            slots.index(node) if node in slots else -1)
        return pod.spec.node_name if pod is not None and pod.spec.node_name else node

    def stop(self, attempt: Attempt, grace_seconds: float = 5.0) -> list[str]:
        """Ask the pods' agents to stop over the channel, then delete the Job in the
        foreground; return the pods still there (should be none). An agent that was asked
        stops its ranks at once and takes its pod's SIGTERM as Relay's stop; one that was
        not (frozen, unreachable) takes it as a preemption notice and stops within the grace."""
        channel = self.channel(attempt)
        asked = channel.ask_to_stop()
        log.info("Stopping %s: agents that said yes: %s", AttemptKey.of(attempt).name,
                 ", ".join(sorted(asked)) or "none")
        return self._stop_job(AttemptKey.of(attempt).name, grace_seconds, asked)

    def stop_all(self, segment_dir: Path) -> list[str]:
        """Stop every Job of a segment, whichever attempt and worker created it (the agents
        of an attempt whose folder is here are asked first, as by :meth:`stop`)."""
        key = AttemptKey.from_dir(Path(segment_dir) / "try-0")
        jobs = self._call(self.batch.list_namespaced_job, self.namespace,
                          label_selector=f"{LABEL_SEGMENT_KEY}={key.segment_key}").items
        survivors: list[str] = []
        for job in jobs:
            attempt = Attempt(Path(segment_dir) / f"try-{job.metadata.labels.get(LABEL_ATTEMPT)}")
            if AttemptKey.of(attempt).name == job.metadata.name and self._knows(attempt):
                survivors += self.stop(attempt)
            else:  # no channel secret here to ask its agents with
                survivors += self._stop_job(job.metadata.name, 5.0, set())
        return survivors

    @staticmethod
    def _knows(attempt: Attempt) -> bool:
        """Return whether this worker has the attempt's launch record (its channel secret)."""
        try:
            launch_record.config_of(attempt.runs_in)
        except (OSError, ValueError, TypeError):
            return False
        return True

    def _stop_job(self, name: str, grace_seconds: float, stopping: set[str]) -> list[str]:
        """Delete the Job in the foreground and wait for its pods; ``stopping``: the slots
        whose agents said they stop (the others' pods get only ``grace_seconds``)."""
        selector = f"relay.dev/attempt-id={name}"
        try:
            self._call(self.batch.delete_namespaced_job, name, self.namespace,
                       body=client.V1DeleteOptions(propagation_policy="Foreground"))
            log.info("Deleting Job %s/%s (foreground)", self.namespace, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
        self._hurry_unasked(selector, stopping, grace_seconds)
        self._wait_pods_gone(selector, termination_grace(self.settings) + grace_seconds)
        left = self._pods(selector)
        for pod in left:
            # Its kubelet is not acting (node down or partitioned): drop the API object so
            # the attempt ends; processes there may run on until the node returns.
            log.warning("Pod %s on %s did not terminate; force-deleting it (its node may be "
                        "unresponsive)", pod.metadata.name, pod.spec.node_name)
            try:
                self._call(self.core.delete_namespaced_pod, pod.metadata.name, self.namespace,
                           grace_period_seconds=0)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        return [f"pod {p.metadata.name}" for p in self._pods(selector)]

    def _hurry_unasked(self, selector: str, stopping: set[str], grace_seconds: float) -> None:
        """Delete, with Relay's stop grace, the pods whose agents did not say they stop.

        Their SIGTERM reads as a preemption notice (the ask never reached them) and the
        pod's grace is a notice's (``kubernetes.termination_grace``, 30 s by default): a
        stop would wait for all of it, and for a frozen node's pod before it counts as stuck.
        Deleting again with a shorter grace shortens the pod's (its deletionTimestamp moves).
        The Job is being deleted first, so its controller makes no replacement."""
        job = self._job_named(selector.split("=", 1)[1])
        slots = json.loads(job.metadata.annotations[ANNOTATION_NODES]) if job is not None else []
        for index, pod in newest_by_index(self._pods(selector)).items():
            if index < len(slots) and slots[index] in stopping:
                continue
            try:
                self._call(self.core.delete_namespaced_pod, pod.metadata.name, self.namespace,
                           grace_period_seconds=math.ceil(grace_seconds))
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def _wait_pods_gone(self, selector: str, timeout: float) -> None:
        """Watch the attempt's pods until each is gone or stuck, or ``timeout`` passes."""
        listed = self._call(self.core.list_namespaced_pod, self.namespace,
                            label_selector=selector)
        left = {p.metadata.name for p in listed.items if not stuck(p, time.time())}
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            stream = watch.Watch().stream(
                self.core.list_namespaced_pod, self.namespace, label_selector=selector,
                resource_version=listed.metadata.resource_version,
                timeout_seconds=max(1, int(deadline - time.monotonic())))
            with closing(stream):  # closes the HTTP response when we stop early
                for event in stream:
                    pod = event["object"]
                    if event["type"] == "DELETED" or stuck(pod, time.time()):
                        left.discard(pod.metadata.name)
                    if not left:
                        break

