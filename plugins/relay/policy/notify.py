"""Tell the escalation target: always a log line, and a POST to a webhook when configured.

The endpoint is the policy's ``escalation.connection`` (an Airflow connection
id, so a token lives in Airflow's secrets, not in a YAML file in git) or its
``escalation.webhook`` (an http(s) URL). Delivery is retried with tenacity
within a bound; its outcome is returned as a :class:`Delivery` for the record
and never raised over the decision. URLs are shown with :func:`redact` only:
no user, password or query string reaches a log line or a record.

Whatever the source, only http(s) is spoken: another scheme (``file:``,
``ftp:``...) is refused before anything is sent, and the opener has no handler
for one. A redirect is never followed (it would carry the Authorization header
to wherever it points): the answer is recorded as a failed delivery with the
fix. Each try waits at most :data:`MAX_ESCALATION_TIMEOUT_SECONDS`.
"""

from __future__ import annotations

import base64
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from relay.core.urls import redact
from relay.policy.rules import MAX_ESCALATION_TIMEOUT_SECONDS, Escalation

log = logging.getLogger(__name__)

SCHEMES = ("http", "https")


class EndpointError(ValueError):
    """An escalation endpoint Relay will not POST to (its text says the fix)."""


@dataclass(frozen=True)
class Delivery:
    """What became of one notification."""

    target: str
    channel: str  # "log" or the redacted endpoint
    delivered: bool
    attempts: int = 0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class Endpoint:
    """Where a notification is POSTed, with its secret headers and a printable name."""

    url: str
    headers: dict[str, str]
    shown: str


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _http_only(url: str, source: str) -> None:
    """Raise EndpointError unless ``url`` is an http(s) URL with a host."""
    try:
        parts = urlsplit(url)
        ok = parts.scheme.lower() in SCHEMES and bool(parts.hostname)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        ok = False
    if not ok:
        raise EndpointError(
            f"{source}: expected an http:// or https:// URL with a host, found {redact(url)!r}. "
            "Fix: point it at the webhook's http(s) address; Relay sends escalations over "
            "http(s) only")


def _from_url(url: str) -> Endpoint:
    """Move any ``user:password@`` of a webhook URL into an Authorization header."""
    _http_only(url, "escalation.webhook")
    parts = urlsplit(url)
    headers = {}
    if parts.username is not None:
        headers["Authorization"] = _basic(parts.username or "", parts.password or "")
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    bare = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    return Endpoint(bare, headers, redact(url))


def _from_connection(conn_id: str) -> Endpoint:
    """Build the endpoint from an Airflow connection: host (with scheme), port, extra.endpoint;
    a password alone is a bearer token, a login and password are basic auth."""
    from airflow.sdk import BaseHook  # lazy: only escalations that use it pay for the import

    conn = BaseHook.get_connection(conn_id)
    host = conn.host or ""
    if "://" not in host:
        host = f"{conn.schema or 'https'}://{host}"
    parts = urlsplit(host)
    netloc = f"{parts.hostname}:{conn.port}" if conn.port else parts.netloc
    path = str(conn.extra_dejson.get("endpoint", "")) or parts.path
    url = urlunsplit((parts.scheme, netloc, path if path.startswith("/") or not path
                      else f"/{path}", parts.query, ""))
    _http_only(url, f"Airflow connection {conn_id} (host, schema)")
    headers: dict[str, str] = {}
    if conn.login and conn.password:
        headers["Authorization"] = _basic(conn.login, conn.password)
    elif conn.password:
        headers["Authorization"] = f"Bearer {conn.password}"
    return Endpoint(url, headers, f"Airflow connection {conn_id} ({redact(url)})")


def _retryable(exc: BaseException) -> bool:
    """Retry network trouble and server errors, not a 4xx (the request itself is wrong)."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500 or exc.code == 429
    return isinstance(exc, OSError)


def _opener() -> urllib.request.OpenerDirector:
    """Return an opener for http(s) only that follows no redirect.

    Unlike ``build_opener`` it has no file:, ftp: or data: handler and no redirect
    handler, so a 3xx answer comes back as an HTTPError, with nothing resent.
    """
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.HTTPHandler(),
                    urllib.request.HTTPSHandler(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def _post(endpoint: Endpoint, body: bytes, timeout: float) -> int:
    request = urllib.request.Request(
        endpoint.url, data=body, method="POST",
        headers={"Content-Type": "application/json", **endpoint.headers},
    )
    with _opener().open(request, timeout=min(timeout, MAX_ESCALATION_TIMEOUT_SECONDS)) as response:
        return int(response.status)


def _failure(exc: BaseException) -> str:
    """Word a failed POST for the record (never with a secret)."""
    if isinstance(exc, urllib.error.HTTPError):
        if 300 <= exc.code < 400:
            where = redact(exc.headers.get("Location") or "") or "elsewhere"
            return (f"HTTP {exc.code} {exc.reason}: the endpoint redirects to {where}, and Relay "
                    "follows no redirect (it would carry the credentials along). Fix: set the "
                    "final URL in escalation.webhook or the Airflow connection")
        return f"HTTP {exc.code} {exc.reason}"
    return f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"


def escalate(
    target: str, message: str, escalation: Escalation,
    payload: Mapping[str, Any] | None = None, *, wait_seconds: float = 1.0,
) -> Delivery:
    """Notify ``target``: log it, POST it if an endpoint is configured; never raise."""
    log.error("ESCALATION to %s: %s", target, message)
    if not (escalation.connection or escalation.webhook):
        return Delivery(target, "log", delivered=True)
    try:
        endpoint = (_from_connection(escalation.connection) if escalation.connection
                    else _from_url(str(escalation.webhook)))
    except EndpointError as exc:
        log.error("Escalation to %s not delivered: %s", target, exc)
        return Delivery(target, str(escalation.connection or "webhook"), False, 0, str(exc))
    except Exception as exc:  # noqa: BLE001 - a missing connection must not hide the decision
        error = (f"cannot build the escalation endpoint: {type(exc).__name__}: {exc}. Fix: add "
                 f"Airflow connection {escalation.connection!r} (e.g. AIRFLOW_CONN_"
                 f"{str(escalation.connection).upper()}) or fix escalation.webhook")
        log.error("Escalation to %s not delivered: %s", target, error)
        return Delivery(target, str(escalation.connection or "webhook"), False, 0, error)
    body = json.dumps({"target": target, "message": message, **(payload or {})},
                      default=str).encode()
    retrying = Retrying(
        stop=stop_after_attempt(escalation.attempts),
        wait=wait_exponential(multiplier=wait_seconds, max=30 * wait_seconds),
        retry=retry_if_exception(_retryable), reraise=True,
        before_sleep=before_sleep_log(log, logging.WARNING),
    )
    try:
        status = retrying(_post, endpoint, body, escalation.timeout)
    except Exception as exc:  # noqa: BLE001 - recorded, never raised over the decision
        attempts = retrying.statistics.get("attempt_number", escalation.attempts)
        error = _failure(exc)
        log.error("Escalation to %s via %s failed after %d attempt(s): %s",
                  target, endpoint.shown, attempts, error)
        return Delivery(target, endpoint.shown, False, attempts, error)
    attempts = retrying.statistics.get("attempt_number", 1)
    log.info("Escalation to %s via %s answered %d", target, endpoint.shown, status)
    return Delivery(target, endpoint.shown, True, attempts)
