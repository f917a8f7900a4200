"""End to end through Airflow's own machinery (`airflow dags test`), real MLflow, real DDP.

The core promise: a run that lost a rank mid-segment and was retried by
Airflow ends with the same weights, bit for bit, as an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
from airflow_jobs import (
    assert_same_bits,
    fault_records,
    final_state,
    free_the_pool,
    prepare_jobs,
    run_job_ok,
)
from mlflow.entities import LoggedModelStatus
from processes import workload_processes

from relay.core.settings import REPO_ROOT
from relay.lineage.models import checkpoint_key, checkpoint_models
from relay.lineage.resume_time import PARTS, fault_onset
from relay.lineage.store import TAG_OUTCOME, TAG_SEGMENT, Lineage
from relay.tools.airflow_env import airflow_bin
from relay_train.protocol.launch import FIRST_STEP_FILE

pytestmark = pytest.mark.integration

JOB = """\
job: e2e
seed: 7
total_steps: 90
steps_per_segment: 30
checkpoint_every: 10
nodes: 2
ranks_per_node: 2
model: {context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}
data: {corpus: "builtin:python_docs", batch_size: 8}
retries: 2
retry_delay: 1s
chaos: allowed
"""
DAG_ID = "relay_e2e"
CRASH = {"kind": "crash", "segment": 1, "step": 45, "rank": 1, "attempt": 1}


def _workload_processes(home: Path) -> list[str]:
    return [f"{pid}: {cmd}" for pid, cmd in workload_processes(home).items()]


@pytest.fixture(scope="module")
def airflow_job(relay_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Write the test job spec and prepare the Airflow database; return the environment."""
    return prepare_jobs(relay_home, tmp_path_factory.mktemp("jobs"), {"e2e": JOB})


def _run(env: dict[str, str], relay_home: Path, conf: dict[str, Any], name: str) -> str:
    return run_job_ok(env, relay_home, "e2e", conf, name)


def _final_state(lineage: Lineage, parent: str, where: Path) -> dict[str, Any]:
    state = final_state(lineage, parent, where, [90, 10])
    assert lineage.chain(parent)[-1].parent is None
    return state


@pytest.fixture(scope="module")
def clean_run(
    airflow_job: dict[str, str], relay_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run the job once without faults; return its final checkpoint state."""
    lineage = Lineage.from_settings()
    clean = _run(airflow_job, relay_home, {"chaos": []}, "clean")
    children = lineage.child_runs(clean)
    # No fault: exactly one attempt per segment, each completed.
    assert sorted(c.data.tags[TAG_SEGMENT] for c in children) == ["0", "1", "2"]
    assert {c.data.tags[TAG_OUTCOME] for c in children} == {"completed"}
    return _final_state(lineage, clean, tmp_path_factory.mktemp("clean"))


def _assert_mlflow_shows_it(lineage: Lineage, parent: str, faulted: str) -> None:
    """What MLflow shows of the DAG run: its faults, the failed try, the chain as models."""
    run = lineage.client.get_run(parent)
    assert run.data.tags["relay.faults"] == "crash:1" and run.data.metrics["faults.crash"] == 1
    failed = lineage.client.get_run(faulted).info
    assert failed.status == "FAILED" and failed.run_name.endswith("(crash)")
    models = checkpoint_models(lineage, run.info.experiment_id)
    chain = lineage.chain(parent)
    found = [models[checkpoint_key(m)] for m in chain]  # one READY model per checkpoint
    assert {m.status for m in found} == {LoggedModelStatus.READY}
    assert [m.tags["relay.parent_model_id"] for m in found] == [
        *(m.model_id for m in found[1:]), ""]  # the final model's lineage back to step 0


@pytest.mark.slow  # ~80 s with its clean-run fixture: `make test-slow` (CI runs it)
def test_crashed_and_retried_run_equals_uninterrupted_run_bit_for_bit(
    airflow_job: dict[str, str], relay_home: Path, tmp_path: Path, clean_run: dict[str, Any]
) -> None:
    lineage = Lineage.from_settings()
    faulty = _run(airflow_job, relay_home, {"chaos": [CRASH]}, "faulty")
    children = lineage.child_runs(faulty)
    seg1 = [c for c in children if c.data.tags[TAG_SEGMENT] == "1"]
    assert [c.data.tags[TAG_OUTCOME] for c in seg1] == ["faulted", "completed"]
    # The retry resumed from the last checkpoint before the crash, not from the segment start.
    assert seg1[1].data.params["resume_step"] == "40"
    fault_file = lineage.client.download_artifacts(seg1[0].info.run_id, "fault.json", str(tmp_path))
    fault = json.loads(Path(fault_file).read_text())
    assert fault["kind"] == "crash"
    assert fault["culprit_rank"] == 1
    assert fault["culprit_node"] == "node-a"

    assert_same_bits(clean_run, _final_state(lineage, faulty, tmp_path / "faulty"))
    assert _workload_processes(relay_home) == [], "no workload process may outlive its DAG run"
    _assert_mlflow_shows_it(lineage, faulty, seg1[0].info.run_id)

    # Re-running a finished segment in the same DAG run is a no-op: the latest
    # checkpoint (step 90) is already past its end.
    dag_run_id = lineage.client.get_run(faulty).data.tags["relay.dag_run_id"]
    before = len(lineage.child_runs(faulty))
    out = subprocess.run(
        [airflow_bin(), "tasks", "test", DAG_ID, "segment_000", dag_run_id],
        env=airflow_job, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "already done" in out.stdout + out.stderr
    assert len(lineage.child_runs(faulty)) == before


THREE_FAULTS = [
    {"kind": "hang", "segment": 0, "step": 15, "rank": 2, "attempt": 1},
    {"kind": "stop_node", "segment": 1, "step": 52, "node": "node-a", "attempt": 1},
    # This job's fastest steps take ~5 ms: a 40x straggler stays slow long enough
    # (straggler.sustained is 3 s) to be caught well before the segment ends.
    {"kind": "straggler", "segment": 2, "step": 62, "rank": 3, "factor": 40.0, "attempt": 1},
]


def _assert_time_to_resume_recorded(lineage: Lineage, parent: str, where: Path) -> None:
    """Every recovery's breakdown is in MLflow, complete, and its parts add up (not speed)."""
    faults = [c for c in lineage.child_runs(parent) if c.data.tags[TAG_OUTCOME] == "faulted"]
    assert faults
    for child in faults:
        path = lineage.client.download_artifacts(child.info.run_id, "time_to_resume.json",
                                                 str(where / child.info.run_id))
        result = json.loads(Path(path).read_text())
        assert result["complete"], result
        assert list(result["parts"]) == list(PARTS)
        assert all(s is not None for s in result["parts"].values())
        assert math.fsum(result["parts"].values()) == pytest.approx(result["total"], abs=0.02)
        # The whole, independently: the injected strike to the retry's first step.
        attempt = Path(child.data.params["attempt_dir"])
        retry = attempt.with_name(f"try-{int(attempt.name.split('-')[1]) + 1}")
        first = json.loads((retry / FIRST_STEP_FILE).read_text())["at"]
        assert result["total"] == pytest.approx(first - fault_onset(attempt), abs=0.01)
        assert lineage.client.get_run(child.info.run_id).data.metrics["time_to_resume.total"] \
            == pytest.approx(result["total"])


@pytest.mark.slow  # `make test-slow`; `make demo` runs the same three faults
def test_stalled_rank_dead_node_and_straggler_recover_on_healthy_nodes_bit_for_bit(
    airflow_job: dict[str, str], relay_home: Path, tmp_path: Path, clean_run: dict[str, Any]
) -> None:
    lineage = Lineage.from_settings()
    faulty = _run(airflow_job, relay_home, {"chaos": THREE_FAULTS}, "three-faults")
    records = fault_records(lineage, faulty, tmp_path)
    assert sorted(records) == ["0", "1", "2"]
    hang, node, slow = records["0"], records["1"], records["2"]
    policy_sha = hashlib.sha256((REPO_ROOT / "policies" / "default.yaml").read_bytes()).hexdigest()

    assert hang["fault"]["kind"] == "hang"
    assert (hang["fault"]["culprit_rank"], hang["fault"]["culprit_node"]) == (2, "node-b")
    assert hang["decision"]["rule"] == "rules.hang"
    assert hang["decision"]["action"] == "restart_elsewhere"
    assert hang["decision"]["quarantine_node"] == "node-b"

    assert node["fault"]["kind"] == "node_unresponsive"
    assert node["fault"]["culprit_node"] == "node-a"
    assert node["decision"]["quarantine_node"] == "node-a"

    # The healthy ranks handed over their in-memory state: nothing was recomputed.
    for record in (hang, node):
        assert record["rescued"] is not None, record
        assert record["lost_steps"] == 0
        assert record["next_resume_step"] == record["progress_step"] == record["rescued"]["step"]
    assert hang["rescued"]["rank"] != 2
    assert node["rescued"]["rank"] not in (0, 1)  # node-a's ranks were frozen

    # Before each stop the ranks said where they were; a frozen node's ranks were skipped.
    assert "chaos_hang_forever" in hang["fault"]["evidence"]["stacks"][0]["threads"]["main"][-1]
    assert node["fault"]["evidence"]["stacks_missing_ranks"] == [0, 1]
    assert sorted(s["rank"] for s in node["fault"]["evidence"]["stacks"]) == [2, 3]

    assert slow["fault"]["kind"] == "straggler"
    assert slow["fault"]["culprit_rank"] == 3
    assert slow["decision"]["action"] == "checkpoint_and_migrate"
    assert slow["drained_at_step"] is not None
    assert slow["lost_steps"] == 0, "checkpoint_and_migrate must lose no steps"

    for record in records.values():
        assert record["decision"]["policy_sha256"] == policy_sha
        assert "summary" in record["fault"]["evidence"]

    # Each retry ran on nodes that excluded every node quarantined before it.
    children = lineage.child_runs(faulty)
    placed = {(c.data.tags[TAG_SEGMENT], c.data.tags["relay.try_number"]):
              set(c.data.params["nodes"].split(",")) for c in children}
    assert "node-b" not in placed[("0", "2")]
    assert not {"node-a", "node-b"} & placed[("1", "2")]
    culprit_node = slow["fault"]["culprit_node"]
    assert not {"node-a", "node-b", culprit_node} & placed[("2", "2")]

    _assert_time_to_resume_recorded(lineage, faulty, tmp_path / "resume")

    log = (relay_home / "logs" / "three-faults.log").read_text()
    assert "Segment 0 fault: hang (node node-b, rank 2)" in log
    assert "by rules.hang" in log
    assert "Segment 1 fault: node_unresponsive (node node-a)" in log

    assert_same_bits(clean_run, _final_state(lineage, faulty, tmp_path / "faulty"))
    assert _workload_processes(relay_home) == [], "stopped (SIGSTOP) processes must not survive"


@pytest.mark.slow  # `make test-slow`: ~40 s more, with the clean run's fixture shared
def test_a_node_frozen_just_after_a_boundary_is_the_next_segments_fault(
    airflow_job: dict[str, str], relay_home: Path, tmp_path: Path, clean_run: dict[str, Any]
) -> None:
    # node-a (rank 0's node) freezes, agent and all, one step after segment 0's end, before
    # its agent can report rank 0's crossing; only the other node's ranks, past the boundary,
    # say that segment 0 is done. Its fault belongs to segment 1, whose task adopts the
    # workload: segment 0 is not retried for it (CI once recorded it there, and segment 0's
    # retry was a no-op).
    freeze = {"kind": "stop_node", "segment": 1, "step": 31, "rank": 0, "attempt": 1}
    free_the_pool()  # the tests before this one took nodes out of the pool
    lineage = Lineage.from_settings()
    faulty = _run(airflow_job, relay_home, {"chaos": [freeze]}, "frozen-after-boundary")
    records = fault_records(lineage, faulty, tmp_path)
    assert sorted(records) == ["1"], {k: r["fault"]["kind"] for k, r in records.items()}
    seg0 = [c for c in lineage.child_runs(faulty) if c.data.tags[TAG_SEGMENT] == "0"]
    assert [c.data.tags[TAG_OUTCOME] for c in seg0] == ["completed"]
    rank0_node = seg0[0].data.params["nodes"].split(",")[0]
    assert records["1"]["fault"]["kind"] == "node_unresponsive"
    assert records["1"]["fault"]["culprit_node"] == rank0_node
    assert records["1"]["lost_steps"] == 0
    assert_same_bits(clean_run, _final_state(lineage, faulty, tmp_path / "state"))
