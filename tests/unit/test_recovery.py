"""Escalation notifications: always a log line, and a POST to the webhook when configured."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from local_http import serving

from relay.decide import Decision
from relay.recovery import notify


def _decision() -> Decision:
    return Decision(
        kind="hang", action="escalate", retry=False, backoff_seconds=0.0, quarantine_node=None,
        quarantine_seconds=None, checkpoint_first=False, rollback=False, notify="oncall",
        rule="rules.hang", occurrence=3, max_attempts=3, policy_sha256="ab" * 32,
        reason="the 3rd hang in this segment reaches rules.hang.max_attempts (3)",
    )


@pytest.fixture
def webhook() -> Any:
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with serving(Handler) as url:
        yield f"{url}/hook", received


def test_escalation_posts_the_decision_to_the_webhook(
    webhook: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url, received = webhook
    with caplog.at_level(logging.ERROR, logger="relay.recovery"):
        notify(_decision(), "Segment 1 fault: hang (node node-a, rank 1)", url)
    assert len(received) == 1
    assert received[0]["target"] == "oncall"
    assert received[0]["decision"]["rule"] == "rules.hang"
    assert "Segment 1 fault" in received[0]["message"]
    assert "ESCALATION to oncall" in caplog.text


def test_escalation_without_webhook_is_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="relay.recovery"):
        notify(_decision(), "Segment 2 fault: crash", None)
    assert "ESCALATION to oncall: Segment 2 fault: crash" in caplog.text


def test_unreachable_webhook_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="relay.recovery"):
        notify(_decision(), "Segment 3 fault: nan", "http://127.0.0.1:9/nothing-listens")
    assert "Escalation webhook http://127.0.0.1:9/nothing-listens failed" in caplog.text
