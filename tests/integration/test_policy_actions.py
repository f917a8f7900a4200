"""Policy actions end to end through Airflow: rollback on NaN, escalate with a webhook."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow_jobs import run_job, use_jobs
from webhook import LocalWebhook

from relay.lineage.store import TAG_OUTCOME, TAG_REJECTED, TAG_SEGMENT, Lineage

pytestmark = pytest.mark.integration

JOB = """\
job: actions
seed: 3
total_steps: 30
steps_per_segment: 30
checkpoint_every: 10
model: {context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}
data: {corpus: "builtin:python_docs", batch_size: 8}
policy: ../policies/actions.yaml
chaos: allowed
"""


def _policy(webhook: str) -> str:
    default = (Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text()
    # The shipped default, but a crash escalates at once to a webhook.
    text = default.replace(
        "  crash:                     # a rank exits with an error\n"
        "    action: retry\n"
        "    max_attempts: 3\n"
        "    backoff: {initial: 1s, multiplier: 2, max: 30s}\n",
        "  crash:\n    action: escalate\n    escalate_to: test-oncall\n",
    )
    assert text != default, "policies/default.yaml changed: update this test's crash rule"
    return text.replace("  webhook: null", f"  webhook: {webhook}")


@pytest.fixture(scope="module")
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    hook = LocalWebhook()
    yield hook.url(), hook.received
    hook.close()


@pytest.fixture(scope="module")
def env(
    relay_home: Path, tmp_path_factory: pytest.TempPathFactory, webhook: tuple[str, Any]
) -> dict[str, str]:
    root = tmp_path_factory.mktemp("actions")
    (root / "jobs").mkdir()
    (root / "policies").mkdir()
    (root / "jobs" / "actions.yaml").write_text(JOB)
    (root / "policies" / "actions.yaml").write_text(_policy(webhook[0]))
    return use_jobs(relay_home, root / "jobs")


def _run(
    env: dict[str, str], home: Path, chaos: list[dict[str, Any]], name: str
) -> tuple[int, str]:
    return run_job(env, home, "actions", {"chaos": chaos}, name)


def test_nan_rolls_back_to_the_checkpoint_before_the_newest(
    env: dict[str, str], relay_home: Path
) -> None:
    code, parent = _run(env, relay_home, [{"kind": "nan", "step": 25, "rank": 1}], "nan")
    assert code == 0
    lineage = Lineage.from_settings()
    children = [c for c in lineage.child_runs(parent) if c.data.tags[TAG_SEGMENT] == "0"]
    assert [c.data.tags[TAG_OUTCOME] for c in children] == ["faulted", "completed"]
    assert children[0].data.tags["relay.fault_kind"] == "nan_loss"
    assert children[0].data.tags["relay.decision"] == "rollback"
    # No checkpoint after the NaN was saved (20 was the newest); rollback discards 20 too.
    assert children[1].data.params["resume_step"] == "10"
    assert f"{TAG_REJECTED}step-00000020" in children[0].data.tags
    assert [m.step for m in lineage.chain(parent)] == [30, 20, 10]


def test_escalate_fails_the_task_for_good_and_calls_the_webhook(
    env: dict[str, str], relay_home: Path, webhook: tuple[str, list[dict[str, Any]]]
) -> None:
    code, parent = _run(env, relay_home, [{"kind": "crash", "step": 12, "rank": 3}], "escalate")
    assert code != 0, "the DAG run must fail when the policy escalates"
    lineage = Lineage.from_settings()
    children = lineage.child_runs(parent)
    assert len(children) == 1, "escalate must not retry"
    assert children[0].data.tags["relay.decision"] == "escalate"
    (_, received) = webhook
    assert len(received) == 1
    assert received[0]["target"] == "test-oncall"
    assert received[0]["decision"]["rule"] == "rules.crash"
    assert "Segment 0 fault: crash (node node-b, rank 3)" in received[0]["message"]
    log = (relay_home / "logs" / "escalate.log").read_text()
    assert "ESCALATION to test-oncall" in log
    # The DAG run ended badly: its MLflow run is closed as FAILED with the reason.
    closed = lineage.client.get_run(parent)
    assert closed.info.status == "FAILED"
    assert "Segment 0 fault: crash" in closed.data.tags["relay.failure_reason"]
    assert closed.data.tags["relay.failed_task"] == "segment_000"
