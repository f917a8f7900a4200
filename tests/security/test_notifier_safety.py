"""The notifier speaks http(s) only, follows no redirect with credentials, and waits boundedly.

Real HTTP servers on 127.0.0.1: the escalation endpoint answers with a redirect to
a second server on another port, which records whatever reaches it. A URL of any
other scheme is refused wherever it comes from: the policy file (with its line),
an Airflow connection, or an Escalation built in code.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from local_http import serving

from relay.core.exceptions import ConfigError
from relay.core.settings import REPO_ROOT
from relay.policy.model import load_policy
from relay.policy.notify import escalate
from relay.policy.rules import Escalation


class _Recorder(BaseHTTPRequestHandler):
    """Record the headers of every request, whatever its method, and answer 204."""

    seen: list[dict[str, str]]

    def _record(self) -> None:
        self.seen.append(dict(self.headers))
        self.send_response(204)
        self.end_headers()

    do_GET = do_POST = do_PUT = do_HEAD = _record  # noqa: N815 - http.server's names

    def log_message(self, *args: Any) -> None:
        pass


class Redirecting:
    """A redirecting endpoint's URL, the status it answers and the headers it got."""

    def __init__(self, to: str) -> None:
        self.to = to
        self.url = ""
        self.status = 307
        self.seen: list[dict[str, str]] = []


@pytest.fixture
def elsewhere() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """The host a redirect points to (another port): it must receive nothing."""
    seen: list[dict[str, str]] = []
    handler = type("Elsewhere", (_Recorder,), {"seen": seen})
    with serving(handler) as url:
        yield f"{url}/hook", seen


@pytest.fixture
def redirecting(elsewhere: tuple[str, list[dict[str, str]]]) -> Iterator[Redirecting]:
    """An endpoint that answers every POST with a redirect to ``elsewhere``."""
    endpoint = Redirecting(elsewhere[0])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            endpoint.seen.append(dict(self.headers))
            self.send_response(endpoint.status)
            self.send_header("Location", endpoint.to)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with serving(Handler) as url:
        endpoint.url = url
        yield endpoint


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_no_credential_leaves(
    status: int, elsewhere: tuple[str, list[dict[str, str]]], redirecting: Redirecting
) -> None:
    redirecting.status = status
    esc = Escalation(webhook=redirecting.url.replace("http://", "http://relay:s3cret@") + "/hook")

    delivery = escalate("oncall", "m", esc, wait_seconds=0)

    assert not delivery.delivered
    assert delivery.attempts == 1, "a redirect is not retried"
    assert redirecting.seen[0]["Authorization"].startswith("Basic ")
    assert elsewhere[1] == [], "the redirect was followed"
    assert "follows no redirect" in (delivery.error or "")
    assert "s3cret" not in (delivery.error or "")


def test_a_redirect_from_an_airflow_connection_keeps_the_token_home(
    elsewhere: tuple[str, list[dict[str, str]]], redirecting: Redirecting,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    redirecting.status = 302
    monkeypatch.setenv("AIRFLOW_CONN_RELAY_ONCALL", json.dumps({
        "conn_type": "http", "host": redirecting.url, "password": "tok-123",
        "extra": {"endpoint": "/hook"}}))

    delivery = escalate("oncall", "m", Escalation(connection="relay_oncall"))

    assert not delivery.delivered
    assert redirecting.seen[0]["Authorization"] == "Bearer tok-123"
    assert elsewhere[1] == []


@pytest.mark.parametrize("conn", [
    {"conn_type": "http", "host": "file:///etc/passwd"},
    {"conn_type": "http", "host": "127.0.0.1", "schema": "ftp", "port": 21},
    {"conn_type": "http", "host": "data:text/plain,hello"},
    {"conn_type": "http", "host": "", "schema": "https"},
], ids=["file", "ftp", "data", "no host"])
def test_an_airflow_connection_to_another_scheme_is_refused_with_the_fix(
    conn: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_RELAY_ONCALL", json.dumps({**conn, "password": "tok"}))

    delivery = escalate("oncall", "m", Escalation(connection="relay_oncall"))

    assert (delivery.delivered, delivery.attempts) == (False, 0)
    assert "Airflow connection relay_oncall" in (delivery.error or "")
    assert "expected an http:// or https:// URL" in (delivery.error or "")
    assert "tok" not in (delivery.error or "").replace("relay_oncall", "")


@pytest.mark.parametrize("webhook", ["file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://h/"])
def test_a_webhook_of_another_scheme_is_refused_in_the_policy_file_and_in_code(
    webhook: str, tmp_path: Path
) -> None:
    shipped = (REPO_ROOT / "policies" / "default.yaml").read_text()
    line = next(i for i, text in enumerate(shipped.splitlines(), 1)
                if text.startswith("  webhook:"))
    path = tmp_path / "policy.yaml"
    path.write_text(shipped.replace("  webhook: null", f"  webhook: {webhook}", 1))
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    assert [(p.field, p.line) for p in caught.value.problems] == [("escalation.webhook", line)]

    built = Escalation.model_construct(webhook=webhook, connection=None, target="oncall",
                                       attempts=1, timeout=1.0)  # skips the model's checks
    delivery = escalate("oncall", "m", built)
    assert (delivery.delivered, delivery.attempts) == (False, 0)
    assert "expected an http:// or https:// URL" in (delivery.error or "")


def test_the_timeout_is_bounded_in_the_policy_and_ends_a_silent_endpoint(
    tmp_path: Path
) -> None:
    shipped = (REPO_ROOT / "policies" / "default.yaml").read_text()
    path = tmp_path / "policy.yaml"
    path.write_text(shipped.replace("  timeout: 10s", "  timeout: 1h", 1))
    with pytest.raises(ConfigError, match="escalation.timeout") as caught:
        load_policy(path)
    assert "at most a minute" in str(caught.value)

    release = threading.Event()

    class Silent(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            release.wait(60)  # answers nothing until the test is done

        def log_message(self, *args: Any) -> None:
            pass

    with serving(Silent) as url:
        try:
            delivery = escalate("oncall", "m", Escalation(webhook=url, attempts=1,
                                                          timeout="500ms"))
        finally:
            release.set()
    assert (delivery.delivered, delivery.attempts) == (False, 1)
    assert "timed out" in (delivery.error or "")
