"""Who may read and who may reach one segment attempt: its Secret and its NetworkPolicy.

The launch file travels in a ConfigMap, which anyone allowed to read ConfigMaps in
the namespace can read; what it must not carry in clear (the MLflow tracking URI,
which may hold credentials, and the channel secret when the launch data has one)
goes in a Secret of the attempt's own, which the pods read as env variables
(``objects.SECRET_ENV``). The NetworkPolicy lets in to the attempt's pods only the
attempt's own pods (the rendezvous and the collectives' connections, whose ports
gloo and NCCL choose) and Airflow's workers and triggerer, to the agents' port
only. Both are owned by the attempt's Job and deleted with it. Plain data, like
``objects``.
"""

from __future__ import annotations

from typing import Any

from relay.launchers.k8s.objects import (
    LABEL_ATTEMPT_ID,
    SECRET_CHANNEL,
    SECRET_TRACKING_URI,
    AttemptKey,
    object_metadata,
)
from relay.spec.sections import KubernetesSpec
from relay_train.protocol.routes import AGENT_PORT

# The launch data's fields that go in the Secret instead of the ConfigMap.
SECRET_FIELDS = {"tracking_uri": SECRET_TRACKING_URI, "channel_secret": SECRET_CHANNEL}
# The official Airflow chart's label on its pods; the worker and the triggerer reach agents.
AIRFLOW_COMPONENT_LABEL = "component"
AIRFLOW_COMPONENTS = ["worker", "triggerer"]


def split_launch(launch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Return the launch data with its secret fields emptied (for the ConfigMap), and those
    fields' values by Secret key (for the Secret; empty values are left out)."""
    public = dict(launch)
    secret: dict[str, str] = {}
    for field, item in SECRET_FIELDS.items():
        if field in public:
            value = public[field]
            public[field] = ""
            if value:
                secret[item] = str(value)
    return public, secret


def secret_manifest(key: AttemptKey, namespace: str, owner: dict[str, Any],
                    values: dict[str, str]) -> dict[str, Any]:
    """Return the attempt's Secret: ``values`` by key, immutable, owned by the Job."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_metadata(key, namespace, owner),
        "type": "Opaque",
        "immutable": True,
        "stringData": dict(values),
    }


def network_policy_manifest(key: AttemptKey, k8s: KubernetesSpec,
                            owner: dict[str, Any]) -> dict[str, Any]:
    """Return the attempt's NetworkPolicy: its own pods on any port, Airflow's workers and
    triggerer on the agents' port, nobody else (deploy/networkpolicy.yaml denies the rest)."""
    own_pods = {"podSelector": {"matchLabels": {LABEL_ATTEMPT_ID: key.name}}}
    airflow = {
        "namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": k8s.airflow_namespace}},
        "podSelector": {"matchExpressions": [{
            "key": AIRFLOW_COMPONENT_LABEL, "operator": "In", "values": AIRFLOW_COMPONENTS}]},
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_metadata(key, k8s.namespace, owner),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_ATTEMPT_ID: key.name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own_pods]},  # rendezvous (29500), then gloo's or NCCL's own ports
                {"from": [airflow], "ports": [{"protocol": "TCP", "port": AGENT_PORT}]},
            ],
        },
    }
