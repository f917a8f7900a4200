"""The Kubernetes launcher's API clients: the cncf.kubernetes provider's ``KubernetesHook``
(its connection, kubeconfig or in-cluster credentials), the official ``kubernetes``
client per API group, and calls retried by tenacity on transient errors only (429, 5xx,
a dropped connection), never on 404 or 409, which mean something.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import tenacity
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from relay.launchers.k8s.channel_ca import channel_client_context
from relay.spec.sections import KubernetesSpec

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

log = logging.getLogger("relay.launchers.k8s.launcher")  # the launcher's log: one place to read
T = TypeVar("T")

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in TRANSIENT_STATUS
    return isinstance(exc, HTTPError)


class KubernetesClients:
    """The API half of :class:`relay.launchers.k8s.launcher.KubernetesLauncher`, which sets
    these attributes."""

    settings: KubernetesSpec
    conn_id: str | None
    retry_wait_seconds: float
    api_attempts: int
    _hook: KubernetesHook | None

    @cached_property
    def hook(self) -> KubernetesHook:
        """Return the provider's hook (built lazily: DAG parsing must not need a cluster)."""
        if self._hook is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            self._hook = KubernetesHook(conn_id=self.conn_id)
        return self._hook

    @cached_property
    def core(self) -> client.CoreV1Api:
        """Return the core/v1 client of the hook's connection."""
        return self.hook.core_v1_client

    @cached_property
    def batch(self) -> client.BatchV1Api:
        """Return the batch/v1 client of the hook's connection."""
        return self.hook.batch_v1_client

    @cached_property
    def networking(self) -> client.NetworkingV1Api:
        """Return the networking.k8s.io/v1 client (the attempt's NetworkPolicy)."""
        return client.NetworkingV1Api(api_client=self.hook.api_client)

    @cached_property
    def coordination(self) -> client.CoordinationV1Api:
        """Return the coordination.k8s.io/v1 client (node Leases)."""
        return client.CoordinationV1Api(api_client=self.hook.api_client)

    @cached_property
    def channel_tls(self) -> ssl.SSLContext | None:
        """Return the TLS context the agents are verified by (its CA read once), None when the
        spec keeps the channel clear (see relay.launchers.k8s.channel_ca)."""
        return channel_client_context(self.core, self.namespace, self.settings.channel_ca_secret)

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:  # noqa: ANN401
        """Call the API, retrying transient failures only."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_transient),
            stop=tenacity.stop_after_attempt(self.api_attempts),
            wait=tenacity.wait_exponential(multiplier=self.retry_wait_seconds, max=10),
            before_sleep=tenacity.before_sleep_log(log, logging.WARNING),
            reraise=True,
        )
        return retrying(fn, *args, **kwargs)

    def _as_dict(self, obj: Any) -> dict[str, Any]:  # noqa: ANN401 - a client model
        return self.hook.api_client.sanitize_for_serialization(obj)

    @property
    def namespace(self) -> str:
        """Return the namespace attempts run in."""
        return self.settings.namespace
