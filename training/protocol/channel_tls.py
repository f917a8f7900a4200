"""TLS on the channel between Relay and the node agents, where it crosses hosts. Stdlib only.

Locally every agent listens on 127.0.0.1 and the channel stays clear text. On
Kubernetes the agents listen on their pod's address and Relay reaches them from
an Airflow worker on another host: there the agent serves TLS with a certificate
and key mounted from a Secret (their paths in :data:`ENV_CHANNEL_TLS_CERT` and
:data:`ENV_CHANNEL_TLS_KEY`), and Relay verifies it against the deployment's
channel CA. TLS 1.2 at least, on both sides.

Which name is checked: the client dials a per-attempt address (the pod's
headless-Service DNS name, ``<job>-<index>.<job>.<namespace>.svc``, or its IP),
and no certificate made before the attempt can list those: a wildcard covers one
label only, and pod IPs change with every pod. So the client verifies the chain
against the channel CA *and* checks the certificate for one fixed name,
:data:`AGENT_TLS_NAME` (a DNS subjectAltName of the agents' certificate),
whatever address it dialled. A certificate the same CA issued for another name is
refused; the CA should be one made for the channel (see docs/security.md).

The agent's side does each handshake in the request's own thread, bounded by
:data:`HANDSHAKE_TIMEOUT_SECONDS`: a stranger who connects and says nothing, or
speaks clear HTTP, costs that thread only, never the accept loop, and is logged
in one line, not a traceback.
"""

from __future__ import annotations

import logging
import os
import socketserver
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relay_train.protocol.env import ENV_CHANNEL_TLS_CERT, ENV_CHANNEL_TLS_KEY

log = logging.getLogger("relay_train.protocol.channel_tls")

AGENT_TLS_NAME = "relay-agent"  # the DNS name every agent certificate carries; the client checks it
MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2
HANDSHAKE_TIMEOUT_SECONDS = 10.0


# -- the agent's side -----------------------------------------------------------------


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """Return the agent's TLS context; raise ValueError (expected, found, what to do) when the
    certificate or key is missing, unreadable or not a matching PEM pair."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION
    try:
        context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    except ssl.SSLError as exc:
        raise ValueError(
            f"channel TLS: expected a PEM certificate in {cert_file} ({ENV_CHANNEL_TLS_CERT}) "
            f"and its private key in {key_file} ({ENV_CHANNEL_TLS_KEY}), found files that do "
            f"not load as a matching pair ({exc.reason or exc}). Recreate the Secret with "
            "kubectl create secret tls NAME --cert=agent.crt --key=agent.key") from exc
    except OSError as exc:
        raise ValueError(
            f"channel TLS: expected readable files {cert_file} ({ENV_CHANNEL_TLS_CERT}) and "
            f"{key_file} ({ENV_CHANNEL_TLS_KEY}), found {exc.strerror or exc} for "
            f"{exc.filename or cert_file}. Check that the pod mounts the channel's TLS Secret "
            "(kubernetes.channel_tls_secret) and that it has tls.crt and tls.key") from exc
    return context


def server_context_from_env(environ: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """Return the agent's TLS context if its environment names a certificate and key, else None
    (clear text); raise ValueError when only one is named or either cannot be loaded."""
    env = os.environ if environ is None else environ
    cert, key = env.get(ENV_CHANNEL_TLS_CERT) or "", env.get(ENV_CHANNEL_TLS_KEY) or ""
    if not cert and not key:
        return None
    if not cert or not key:
        missing, given = ((ENV_CHANNEL_TLS_CERT, ENV_CHANNEL_TLS_KEY) if not cert
                          else (ENV_CHANNEL_TLS_KEY, ENV_CHANNEL_TLS_CERT))
        raise ValueError(
            f"channel TLS: expected both {ENV_CHANNEL_TLS_CERT} and {ENV_CHANNEL_TLS_KEY}, found "
            f"only {given}. Set {missing} too (the Kubernetes launcher sets both), or neither "
            "for clear text")
    return server_context(Path(cert), Path(key))


def serve_tls(server: socketserver.TCPServer, context: ssl.SSLContext | None) -> None:
    """Make ``server`` speak TLS with ``context`` (nothing when it is None: clear text).

    Wraps its listening socket; each accepted connection does its handshake in its own
    request thread (see :class:`_HandshakeInItsThread`).
    """
    if context is None:
        return
    context.sslsocket_class = _HandshakeInItsThread
    server.socket = context.wrap_socket(server.socket, server_side=True,
                                        do_handshake_on_connect=False)


class _HandshakeInItsThread(ssl.SSLSocket):
    """An accepted connection whose handshake runs at its first read, in its request's thread.

    A failed or silent handshake reads as the end of the stream: the HTTP handler sees an
    empty request and closes, and the refusal is one log line.
    """

    _relay_handshake_done = False

    def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:  # noqa: ANN401
        if not self._relay_handshake_done:
            self._relay_handshake_done = True
            if not self._bounded_handshake():
                return 0
        return super().recv_into(buffer, nbytes, flags)

    def _bounded_handshake(self) -> bool:
        previous = self.gettimeout()
        bound = HANDSHAKE_TIMEOUT_SECONDS if previous is None else min(
            previous, HANDSHAKE_TIMEOUT_SECONDS)
        try:
            self.settimeout(bound)
            self.do_handshake()
        except OSError as exc:  # ssl.SSLError, a reset, or the bound passed
            try:
                host, port = self.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                peer = "a peer that left"
            log.warning("channel: refused a connection from %s: no TLS handshake (%s)", peer,
                        getattr(exc, "reason", None) or exc)
            return False
        finally:
            try:
                self.settimeout(previous)
            except OSError:
                pass
        return True


# -- Relay's side -----------------------------------------------------------------------


def client_context(ca_pem: str, agent_name: str = AGENT_TLS_NAME) -> ssl.SSLContext:
    """Return Relay's TLS context for the channel: trust only ``ca_pem`` (PEM text) and check
    every agent's certificate for ``agent_name``, whatever address was dialled.

    Raise ValueError when ``ca_pem`` holds no certificate.
    """
    context = _AgentNameContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    context.minimum_version = MINIMUM_VERSION
    context.agent_name = agent_name
    try:
        context.load_verify_locations(cadata=ca_pem)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(
            "channel TLS: expected the channel CA as PEM text (-----BEGIN CERTIFICATE-----...), "
            f"found something that does not load ({exc}). Put the CA certificate that signed "
            "the agents' certificate in the CA Secret's ca.crt") from exc
    return context


class _AgentNameContext(ssl.SSLContext):
    """A client context that checks every server certificate for one name (the agents')."""

    agent_name: str = AGENT_TLS_NAME

    def wrap_socket(self, sock: Any, server_side: bool = False,  # noqa: ANN401, D102, FBT001, FBT002
                    do_handshake_on_connect: bool = True,  # noqa: FBT001, FBT002
                    suppress_ragged_eofs: bool = True,  # noqa: FBT001, FBT002
                    server_hostname: str | None = None,  # noqa: ARG002 - replaced by the agents' name
                    session: Any = None) -> ssl.SSLSocket:  # noqa: ANN401
        return super().wrap_socket(sock, server_side=server_side,
                                   do_handshake_on_connect=do_handshake_on_connect,
                                   suppress_ragged_eofs=suppress_ragged_eofs,
                                   server_hostname=self.agent_name, session=session)
