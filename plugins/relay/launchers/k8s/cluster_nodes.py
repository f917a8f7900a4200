"""What the Kubernetes launcher reads and writes on the cluster's nodes: whether a node
is unresponsive (NotReady, or its kubelet's Lease stopped moving, judged on Relay's
clock) and the NoSchedule taint of a quarantined node."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from relay.launchers.k8s.clients import KubernetesClients
from relay.launchers.k8s.objects import QUARANTINE_TAINT_KEY, quarantine_taint

if TYPE_CHECKING:
    from relay.nodes.pool import Quarantine

log = logging.getLogger("relay.launchers.k8s.launcher")  # the launcher's log: one place to read

LEASE_NAMESPACE = "kube-node-lease"
LEASE_STALE_SECONDS = 20.0  # the kubelet renews its Lease every 10 s
NODE_CHECK_SECONDS = 2.0  # a node's Ready condition and lease are read at most this often


class KubernetesNodes(KubernetesClients):
    """The node half of :class:`relay.launchers.k8s.launcher.KubernetesLauncher` (the API
    clients, the retrying ``_call`` and the settings: :class:`KubernetesClients`)."""

    lease_stale_seconds: float
    node_check_seconds: float
    _checked: dict[str, tuple[float, str | None]]  # host -> (when, problem)
    _leases: dict[str, tuple[Any, float]]  # host -> (renewTime, first seen)

    def _node_problem(self, host: str) -> str | None:
        """Return why ``host`` counts as unresponsive, or None (re-read every few seconds)."""
        checked = self._checked.get(host)
        if checked is not None and time.monotonic() - checked[0] < self.node_check_seconds:
            return checked[1]
        problem = self._read_node_problem(host)
        self._checked[host] = (time.monotonic(), problem)
        return problem

    def _read_node_problem(self, host: str) -> str | None:
        try:
            node = self._call(self.core.read_node, host)
        except ApiException as exc:
            if exc.status == 404:
                return f"node {host} is gone from the cluster"
            raise
        ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
        if ready is not None and ready.status != "True":
            return (f"node {host} is NotReady ({ready.reason or 'no reason'}) since "
                    f"{ready.last_transition_time}")
        return self._lease_problem(host)

    def _lease_problem(self, host: str) -> str | None:
        """Return a problem if the kubelet's Lease stopped moving, measured on Relay's clock."""
        try:
            lease = self._call(self.coordination.read_namespaced_lease, host, LEASE_NAMESPACE)
        except ApiException as exc:
            if exc.status in (403, 404):  # no RBAC for leases, or no lease: rely on Ready
                return None
            raise
        renewed = lease.spec.renew_time
        seen = self._leases.get(host)
        now = time.monotonic()
        if seen is None or seen[0] != renewed:
            self._leases[host] = (renewed, now)
            return None
        quiet = now - seen[1]
        if quiet > self.lease_stale_seconds:
            return f"the kubelet of {host} has not renewed its lease for {quiet:.0f}s"
        return None

    def enforce_quarantines(self, held: dict[str, Quarantine]) -> None:
        """Taint quarantined nodes NoSchedule (value: expiry), untaint released ones."""
        if not self.settings.taint_quarantine:
            return
        now = time.time()
        try:
            for node in self._call(self.core.list_node).items:
                quarantine = held.get(node.metadata.name)
                want = quarantine_taint(quarantine.until) \
                    if quarantine and quarantine.active(now) else None
                self._set_taint(node, want)
        except ApiException as exc:
            if exc.status != 403:
                raise
            # The nodeAffinity NotIn of every attempt still keeps quarantined nodes out.
            log.warning("taint_quarantine is on, but Relay may not list or patch nodes (403 "
                        "Forbidden: %s). Quarantines are still enforced by nodeAffinity; to "
                        "taint nodes too, bind ClusterRole relay-node-tainter "
                        "(deploy/rbac-taint-quarantine.yaml) to Relay's service account, or set "
                        "kubernetes.taint_quarantine: false", exc.reason)

    def _set_taint(self, node: Any, want: dict[str, Any] | None) -> None:  # noqa: ANN401
        """Make ``want`` the node's only Relay taint; retry on a concurrent change (409)."""
        for _ in range(3):
            taints = [self._as_dict(t) for t in node.spec.taints or []]
            ours = [t for t in taints if t["key"] == QUARANTINE_TAINT_KEY]
            if (want is None and not ours) or (want is not None and ours == [want]):
                return
            others = [t for t in taints if t["key"] != QUARANTINE_TAINT_KEY]
            body = {"metadata": {"resourceVersion": node.metadata.resource_version},
                    "spec": {"taints": others + ([want] if want else [])}}
            try:
                self._call(self.core.patch_node, node.metadata.name, body,
                           _content_type="application/merge-patch+json")
                log.warning("Node %s: %s", node.metadata.name,
                            f"tainted {QUARANTINE_TAINT_KEY} until {want['value']}" if want
                            else "quarantine taint removed")
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
                node = self._call(self.core.read_node, node.metadata.name)
        raise RuntimeError(f"node {node.metadata.name}: its taints kept changing under Relay; "
                           "try again, or check who else edits them")
