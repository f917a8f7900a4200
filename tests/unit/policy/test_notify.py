"""Escalation notifications: a log line always; a POST to a webhook or an Airflow connection,
retried within a bound, its failure recorded and never raised; no secret is ever logged."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException
from webhook import LocalWebhook

from relay.policy.notify import escalate, redact
from relay.policy.rules import Escalation


@pytest.fixture
def hook() -> Iterator[LocalWebhook]:
    h = LocalWebhook()
    yield h
    h.close()


def test_a_webhook_gets_the_payload_and_the_credentials_only_as_a_header(
    hook: LocalWebhook, caplog: pytest.LogCaptureFixture
) -> None:
    esc = Escalation(webhook=hook.url("bot:hunter2@") + "?token=s3cret")
    with caplog.at_level(logging.INFO):
        delivery = escalate("oncall", "Segment 1 fault: hang", esc, {"decision": {"rule": "r"}})
    assert delivery.delivered and delivery.attempts == 1
    assert hook.received == [{"target": "oncall", "message": "Segment 1 fault: hang",
                              "decision": {"rule": "r"}}]
    assert hook.headers[0]["Authorization"].startswith("Basic ")
    assert "ESCALATION to oncall: Segment 1 fault: hang" in caplog.text
    for secret in ("hunter2", "s3cret", "bot:"):
        assert secret not in caplog.text
        assert secret not in json.dumps(delivery.to_dict())


def test_an_airflow_connection_keeps_the_token_out_of_the_policy(
    hook: LocalWebhook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_RELAY_ONCALL", json.dumps({
        "conn_type": "http", "host": "127.0.0.1", "port": hook.port, "schema": "http",
        "password": "tok-123", "extra": {"endpoint": "/hook"}}))
    with caplog.at_level(logging.INFO):
        delivery = escalate("oncall", "m", Escalation(connection="relay_oncall"))
    assert delivery.delivered
    assert hook.headers[0]["Authorization"] == "Bearer tok-123"
    assert "tok-123" not in caplog.text
    assert "relay_oncall" in delivery.channel


def test_a_missing_connection_is_recorded_with_the_fix_not_raised() -> None:
    delivery = escalate("oncall", "m", Escalation(connection="relay_nowhere"))
    assert not delivery.delivered
    assert "AIRFLOW_CONN_RELAY_NOWHERE" in (delivery.error or "")


def test_server_errors_are_retried_and_a_later_success_counts(hook: LocalWebhook) -> None:
    hook.statuses = [500, 503]
    delivery = escalate("oncall", "m", Escalation(webhook=hook.url()), wait_seconds=0)
    assert delivery.delivered and delivery.attempts == 3
    assert len(hook.received) == 3


def test_a_client_error_is_not_retried(hook: LocalWebhook) -> None:
    hook.statuses = [403]
    delivery = escalate("oncall", "m", Escalation(webhook=hook.url()), wait_seconds=0)
    assert not delivery.delivered and delivery.attempts == 1
    assert "403" in (delivery.error or "")


def test_an_unreachable_webhook_is_tried_within_the_bound_then_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    esc = Escalation(webhook="http://127.0.0.1:9/nothing-listens?key=abc", attempts=2)
    with caplog.at_level(logging.WARNING):
        delivery = escalate("oncall", "m", esc, wait_seconds=0)
    assert (delivery.delivered, delivery.attempts) == (False, 2)
    assert "failed after 2 attempt(s)" in caplog.text
    assert "key=abc" not in caplog.text


def test_redact_drops_user_password_and_query() -> None:
    assert redact("https://u:p@h.example:8443/a/b?t=1#f") == "https://h.example:8443/a/b?..."


def test_running_out_of_nodes_escalates_through_the_same_notifier(
    hook: LocalWebhook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.nodes.pool import NodePool
    from relay.operators.segment import TrainSegmentOperator
    from relay.policy.model import LoadedPolicy, Policy
    from relay.spec.job import JobSpec

    monkeypatch.setenv("RELAY_NODES", "node-z")
    monkeypatch.setenv("RELAY_HOME", str(tmp_path))
    NodePool().quarantine("node-z", 600, "test", by="test")
    policy_file = Path(__file__).resolve().parents[3] / "policies" / "default.yaml"
    raw = Policy.model_validate({
        "rules": {k: {"action": "abort"} for k in Policy.model_fields["rules"].annotation
                  .model_fields},
        "nodes": {"when_too_few": "escalate"}, "escalation": {"webhook": hook.url()},
    })
    spec = JobSpec(job="j", total_steps=2, steps_per_segment=1, checkpoint_every=1, nodes=1)
    op = TrainSegmentOperator(task_id="segment_000", segment=0, spec_file="unused.yaml")
    with pytest.raises(AirflowFailException, match="expected 1 healthy nodes"):
        op._nodes(spec, LoadedPolicy(raw, policy_file, "ab" * 32), holder="j/run")
    assert hook.received[0]["reason"] == "not_enough_nodes"
    assert hook.received[0]["target"] == "ml-platform-oncall"
