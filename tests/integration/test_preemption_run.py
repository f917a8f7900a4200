"""A preemption notice end to end through Airflow on the local launcher.

One node agent gets a SIGTERM mid-segment (chaos ``preempt``: a rank of that node sends it to
its agent, as Kubernetes' eviction or Slurm's ``--signal`` would): the fault is ``preempted``,
the ranks drain to a checkpoint within the grace (0 lost steps), the node is not quarantined,
and the retry runs without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from airflow_jobs import fault_records, prepare_jobs, run_job

from relay.lineage.store import TAG_OUTCOME, TAG_SEGMENT, Lineage
from relay.nodes.pool import NodePool

pytestmark = pytest.mark.integration

JOB = """\
job: preempt
seed: 5
total_steps: 60
steps_per_segment: 60
checkpoint_every: 20
nodes: 2
ranks_per_node: 1
model: {context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}
data: {corpus: "builtin:python_docs", batch_size: 8}
retries: 2
retry_delay: 1s
chaos: allowed
policy: ../policies/preempt.yaml
"""
# Rank 1 (the second node) notifies its agent at step 10; the first try is paced so that
# its segment cannot end before Relay has drained it (1 s a step: 50 s of headroom).
CHAOS = [{"kind": "pace", "step": 0, "seconds": 1.0, "attempt": 1},
         {"kind": "preempt", "step": 10, "rank": 1, "attempt": 1}]




def _policy() -> str:
    """The shipped default, with liveness thresholds a loaded test host cannot trip and no
    slowness rules (a loaded host makes stragglers): the preemption is the run's one fault."""
    policy = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
    detection = policy["detection"]
    detection.update(startup_timeout="10m", heartbeat_timeout="60s", hang_timeout="120s",
                     stop_unattended_after="10m", straggler=None, throughput=None)
    return yaml.safe_dump(policy)


@pytest.mark.slow  # one DAG run of two tries: 1-2 min, up to 10 on a loaded host
def test_a_preempted_node_is_drained_not_quarantined_and_left_out_of_the_retry(
        relay_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_PREEMPT_GRACE_SECONDS", "300")  # the agents' platform grace
    (tmp_path / "jobs").mkdir()
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "preempt.yaml").write_text(_policy())
    env = prepare_jobs(relay_home, tmp_path / "jobs", {"preempt": JOB})
    code, parent = run_job(env, relay_home, "preempt", {"chaos": CHAOS}, "preempt",
                           timeout_seconds=900)
    log_file = relay_home / "logs" / "preempt.log"
    assert code == 0, f"airflow dags test failed; see {log_file}"

    lineage = Lineage.from_settings()
    children = sorted((c for c in lineage.child_runs(parent) if c.data.tags[TAG_SEGMENT] == "0"),
                      key=lambda c: int(c.data.params["attempt"]))
    assert [c.data.tags[TAG_OUTCOME] for c in children] == ["faulted", "completed"]
    first_nodes = children[0].data.params["nodes"].split(",")
    retry_nodes = children[1].data.params["nodes"].split(",")

    record = fault_records(lineage, parent, tmp_path / "records")["0"]  # the one fault
    fault, decision = record["fault"], record["decision"]
    preempted = first_nodes[1]
    assert (fault["kind"], fault["culprit_node"]) == ("preempted", preempted)
    assert decision["action"] == "checkpoint_and_migrate"
    assert decision["quarantine_node"] is None and decision["avoid_node"] == preempted
    assert record["drained_at_step"] is not None, record.get("drain_note")
    assert record["lost_steps"] == 0
    assert record["next_resume_step"] == record["drained_at_step"]
    assert children[1].data.params["resume_step"] == str(record["drained_at_step"])

    assert preempted not in retry_nodes  # that retry only ...
    assert preempted not in NodePool().quarantines()  # ... and never quarantined
