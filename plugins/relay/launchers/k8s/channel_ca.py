"""Where Relay's trust in the pods' agents comes from: the channel CA, read from a Secret.

The Kubernetes launcher talks to each pod's agent across hosts over TLS
(:mod:`relay_train.protocol.channel_tls`). It trusts one CA, the deployment's channel
CA, kept in the Secret ``kubernetes.channel_ca_secret`` (key ``ca.crt``) in the
attempts' namespace, and reads it through the API with the launcher's own
credentials (``get`` on that one Secret; deploy/rbac.yaml). The agents' private key
is in another Secret (``kubernetes.channel_tls_secret``) that only the pods mount:
the launcher never reads it.
"""

from __future__ import annotations

import base64
import binascii
import logging
import ssl
from typing import Any

from kubernetes.client.exceptions import ApiException

from relay.core.exceptions import ChannelCAError
from relay_train.protocol.channel_tls import AGENT_TLS_NAME, client_context

log = logging.getLogger(__name__)

CA_KEY = "ca.crt"  # the CA Secret's key (as cert-manager and kubectl examples name it)
_MAKE_IT = ("kubectl -n {ns} create secret generic {name} --from-file=ca.crt=channel-ca.crt "
            "(docs/security.md#tls-between-hosts)")


def channel_ca_pem(core: Any, namespace: str, secret: str) -> str:  # noqa: ANN401 - CoreV1Api
    """Return the PEM text of ``ca.crt`` in Secret ``namespace/secret``; raise ChannelCAError."""
    where = f"Secret {namespace}/{secret} (kubernetes.channel_ca_secret)"
    try:
        found = core.read_namespaced_secret(secret, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise ChannelCAError(
                f"channel TLS: expected the channel CA in {where}, found no such Secret. Create "
                "it: " + _MAKE_IT.format(ns=namespace, name=secret)) from exc
        if exc.status == 403:
            raise ChannelCAError(
                f"channel TLS: expected to read {where}, found the launcher may not (403). "
                "Grant get on that Secret to Airflow's workers and triggerer (the Role "
                "relay-launcher in deploy/rbac.yaml)") from exc
        raise
    raw = (found.data or {}).get(CA_KEY)
    if not raw:
        raise ChannelCAError(
            f"channel TLS: expected key {CA_KEY} in {where}, found keys "
            f"{sorted(found.data or {})}. Recreate it: " + _MAKE_IT.format(ns=namespace,
                                                                          name=secret))
    try:
        return base64.b64decode(raw, validate=True).decode("ascii")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ChannelCAError(f"channel TLS: expected PEM text in {where} key {CA_KEY}, found "
                             f"bytes that are not ({exc})") from exc


def channel_client_context(core: Any, namespace: str,  # noqa: ANN401 - CoreV1Api
                           secret: str | None) -> ssl.SSLContext | None:
    """Return the TLS context the channel verifies the agents by (None: clear text)."""
    if secret is None:
        return None
    try:
        context = client_context(channel_ca_pem(core, namespace, secret))
    except ValueError as exc:
        raise ChannelCAError(f"{exc} (Secret {namespace}/{secret})") from exc
    log.info("Channel TLS: agents verified by the CA in Secret %s/%s, as %r", namespace, secret,
             AGENT_TLS_NAME)
    return context
