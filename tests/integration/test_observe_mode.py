"""Observe mode end to end through Airflow: a straggler is detected, classified, recorded with
the decision Relay would have made and notified, but the job is not stopped; then
`relay policy replay` shows what the enforcing default policy would have done instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from webhook import LocalWebhook

from relay.core.settings import REPO_ROOT
from relay.lineage.store import TAG_DAG_ID, TAG_OUTCOME, Lineage
from relay.nodes.pool import NodePool
from relay.tools.airflow_env import airflow_env, ensure_airflow_db
from relay.tools.demo import run_dag_test

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # `make test-slow`

JOB = """\
job: observe
seed: 5
total_steps: 150
steps_per_segment: 150
checkpoint_every: 50
model: {context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}
data: {corpus: "builtin:python_docs", batch_size: 8}
policy: ../policies/observe.yaml
chaos: allowed
"""
POLICY = """\
version: 1
detection:                   # tolerant of a loaded test machine, except for stragglers
  heartbeat_timeout: 15s
  hang_timeout: 30s
  startup_timeout: 5m
  straggler: {ratio: 1.5, sustained: 1s}
  throughput: null
rules:
  hang:                {action: restart_elsewhere, max_attempts: 3, quarantine: 30m}
  rank_unresponsive:   {action: restart_elsewhere, max_attempts: 3, quarantine: 30m}
  node_unresponsive:   {action: restart_elsewhere, max_attempts: 3, quarantine: 1h}
  straggler:           {action: checkpoint_and_migrate, quarantine: 30m, mode: observe}
  throughput_degraded: {action: checkpoint_and_migrate}
  crash:               {action: retry}
  launch_failure:      {action: restart_elsewhere, quarantine: 15m}
  nan_loss:            {action: rollback}
  corrupt_checkpoint:  {action: rollback}
  short_segment:       {action: abort}
escalation:
  target: test-governance
  webhook: WEBHOOK
"""
STRAGGLER = {"kind": "straggler", "step": 30, "rank": 1, "factor": 3.0}


@pytest.fixture(scope="module")
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    hook = LocalWebhook()
    yield hook.url(), hook.received
    hook.close()


def test_an_observed_straggler_is_recorded_and_notified_and_the_job_runs_on(
    relay_home: Path, tmp_path_factory: pytest.TempPathFactory,
    webhook: tuple[str, list[dict[str, Any]]],
) -> None:
    root = tmp_path_factory.mktemp("observe")
    (root / "jobs").mkdir()
    (root / "policies").mkdir()
    (root / "jobs" / "observe.yaml").write_text(JOB)
    (root / "policies" / "observe.yaml").write_text(POLICY.replace("WEBHOOK", webhook[0]))
    os.environ["RELAY_JOBS_DIR"] = str(root / "jobs")
    pool = NodePool()
    for node in pool.quarantines():
        pool.release(node)
    env = airflow_env(relay_home)
    ensure_airflow_db(env, relay_home / "logs" / "airflow-db.log")
    log_file = relay_home / "logs" / "observe.log"
    proc = run_dag_test("relay_observe", {"chaos": [STRAGGLER]}, env, log_file)
    try:
        code = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, log_file.read_text()[-4000:]

    lineage = Lineage.from_settings()
    (parent,) = lineage.client.search_runs(
        [lineage.experiment_id("observe")], filter_string=f"tags.`{TAG_DAG_ID}` = 'relay_observe'")
    children = lineage.child_runs(parent.info.run_id)
    # Not stopped: one attempt trained every step, and no node was quarantined.
    assert [c.data.tags[TAG_OUTCOME] for c in children] == ["completed"]
    assert children[0].data.tags["relay.observed"].split(",")[0] == "straggler"
    assert pool.quarantines() == {}
    record = json.loads(Path(lineage.client.download_artifacts(
        children[0].info.run_id, "observed/001.json", str(root))).read_text())
    assert record["fault"]["kind"] == "straggler"  # rank 1's, or a rank slowed by the load
    assert record["decision"]["observe"] is True
    assert record["decision"]["action"] == "checkpoint_and_migrate"
    assert record["notification"]["delivered"] is True
    (_, received) = webhook
    assert received[0]["target"] == "test-governance" and received[0]["mode"] == "observe"
    assert received[0]["message"].startswith("OBSERVE MODE (not applied)")

    # Replay: under the enforcing default policy the same straggler would have been migrated.
    replay = subprocess.run(
        [sys.executable, "-m", "relay.tools.cli", "policy", "replay",
         str(REPO_ROOT / "policies" / "default.yaml"), "--job", "observe"],
        capture_output=True, text=True, check=False, timeout=120, env={**os.environ},
    )
    assert replay.returncode == 0, replay.stderr
    assert "straggler (node node-" in replay.stdout and "[CHANGED]" in replay.stdout
    assert "then: checkpoint_and_migrate [observe only]" in replay.stdout
    assert "observed only:             then 1, now 0" in replay.stdout
