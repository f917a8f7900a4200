"""Segment boundaries by adoption, end to end: real Airflow (`airflow dags test`), MLflow, DDP.

One workload trains every segment of a fault-free run (the next segment's task
adopts it at the boundary checkpoint instead of restarting it); a stalled rank
that strikes in the gap, after a segment's task let go of the workload and
before the next one adopted it, is seen by the adopting task's watcher and
recovered as any hang (rescued, 0 lost steps); and both runs end with the same
weights, bit for bit, as a run that restarts at every boundary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from airflow_jobs import assert_same_bits, fault_records, final_state, prepare_jobs, run_job_ok
from processes import workload_processes

from relay.launchers.local.adopt import ADOPTED_FILE, read_adopted
from relay.lineage.store import TAG_OUTCOME, TAG_SEGMENT, Lineage
from relay.nodes.pool import NodePool
from relay.tools.bench.boundary_time import boundaries

pytestmark = pytest.mark.integration

# Checkpoints only at segment ends: rank 0 publishing every few milliseconds of this tiny
# job slows it enough, on a loaded machine, for false straggler alarms on rank 0.
JOB = """\
job: {name}
seed: 7
total_steps: 90
steps_per_segment: 30
checkpoint_every: 30
nodes: 2
ranks_per_node: 2
model: {{context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}}
data: {{corpus: "builtin:python_docs", batch_size: 8}}
retries: 2
retry_delay: 1s
chaos: allowed
segment_boundary: {mode}
"""
# Segment 0's task lets go of its workload at step 30; this strikes before segment 1's
# task adopts it (this job's steps take milliseconds, a task start takes seconds).
GAP_HANG = {"kind": "hang", "segment": 1, "step": 33, "rank": 1, "attempt": 1}


@pytest.fixture(scope="module")
def env(relay_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return prepare_jobs(relay_home, tmp_path_factory.mktemp("jobs"), {
        "adopting": JOB.format(name="adopting", mode="adopt"),
        "restarting": JOB.format(name="restarting", mode="restart")})


def _run_dir(relay_home: Path, job: str) -> Path:
    runs = sorted((relay_home / "runs" / f"relay_{job}").iterdir(),
                  key=lambda p: p.stat().st_mtime)
    return runs[-1]


def _leased_to(parent: str) -> list[str]:
    """Return the nodes still leased to the DAG run of MLflow run ``parent``."""
    dag_run = Lineage.from_settings().client.get_run(parent).data.tags["relay.dag_run_id"]
    return sorted(n for n, lease in NodePool().leases().items()
                  if lease["holder"].endswith(f"/{dag_run}"))


def _workloads(run_dir: Path) -> list[str]:
    """Return the attempt folders that launched processes (segment/try), in order."""
    return sorted(f"{h.parent.parent.name}/{h.parent.name}"
                  for h in run_dir.glob("segment-*/try-*/handle.json"))


@pytest.fixture(scope="module")
def restarted(env: dict[str, str], relay_home: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: a fault-free run that restarts its workload at every boundary."""
    parent = run_job_ok(env, relay_home, "restarting", {"chaos": []}, "restarting")
    run_dir = _run_dir(relay_home, "restarting")
    # Every segment launched its own workload (a false alarm under load may add a retry).
    assert {"segment-000/try-1", "segment-001/try-1", "segment-002/try-1"} <= set(
        _workloads(run_dir))
    assert all(read_adopted(t) is None for t in run_dir.glob("segment-*/try-*"))
    return final_state(Lineage.from_settings(), parent, tmp_path_factory.mktemp("r"), [90, 30])


@pytest.mark.slow  # ~80 s with its clean-run fixture: `make test-slow` (CI runs it)
def test_one_workload_trains_every_segment_and_lineage_stays_true(
    env: dict[str, str], relay_home: Path, tmp_path: Path, restarted: dict[str, Any],
) -> None:
    lineage = Lineage.from_settings()
    parent = run_job_ok(env, relay_home, "adopting", {"chaos": []}, "adopting-clean")
    run_dir = _run_dir(relay_home, "adopting")

    assert _workloads(run_dir) == ["segment-000/try-1"], "no second workload may start"
    for segment in (1, 2):
        adopted = read_adopted(run_dir / f"segment-{segment:03d}" / "try-1")
        assert adopted is not None and adopted["workload"].endswith("segment-000/try-1")
    children = lineage.child_runs(parent)
    assert sorted(c.data.tags[TAG_SEGMENT] for c in children) == ["0", "1", "2"]
    assert {c.data.tags[TAG_OUTCOME] for c in children} == {"completed"}
    by_segment = {c.data.tags[TAG_SEGMENT]: c for c in children}
    assert by_segment["2"].data.params["adopted_workload"].endswith("segment-000/try-1")
    # Each checkpoint is in the run of the attempt that watched the workload when it was
    # made; the chain from the final model back to step 0 is unbroken.
    chain = lineage.chain(parent)
    assert [m.step for m in chain] == [90, 60, 30]
    runs = {m.step: m.run_id for m in chain}
    assert runs[30] == by_segment["0"].info.run_id
    assert runs[90] == by_segment["2"].info.run_id
    assert [b["kind"] for b in boundaries(run_dir)] == ["adopt", "adopt"]

    assert_same_bits(restarted, final_state(lineage, parent, tmp_path, [90, 30]))
    assert workload_processes(relay_home) == {}, "the last segment stops everything"
    assert _leased_to(parent) == [], "the next DAG run gets the nodes back"


@pytest.mark.slow  # ~90 s; `make test-slow` (and CI) run it; keeps `make test` near 10 min
def test_a_hang_in_the_gap_is_seen_by_the_adopting_watcher_and_recovered_bit_for_bit(
    env: dict[str, str], relay_home: Path, tmp_path: Path, restarted: dict[str, Any],
) -> None:
    lineage = Lineage.from_settings()
    parent = run_job_ok(env, relay_home, "adopting", {"chaos": [GAP_HANG]}, "adopting-gap")
    run_dir = _run_dir(relay_home, "adopting")

    hang = fault_records(lineage, parent, tmp_path)["1"]
    assert hang["fault"]["kind"] == "hang" and hang["fault"]["culprit_rank"] == 1
    assert hang["rescued"] is not None and hang["lost_steps"] == 0
    faulty = run_dir / "segment-001" / "try-1"
    assert json.loads((faulty / ADOPTED_FILE).read_text())["workload"].endswith(
        "segment-000/try-1")
    assert (faulty / "decision.json").exists()
    # The retry launched afresh; the segment after it adopted that new workload, though
    # this job's steps take milliseconds: the workload held its final checkpoint back
    # until the last segment's task came, so that segment has an attempt of its own.
    assert _workloads(run_dir) == ["segment-000/try-1", "segment-001/try-2"]
    later = read_adopted(run_dir / "segment-002" / "try-1")
    assert later is not None and later["workload"].endswith("segment-001/try-2")
    final = lineage.chain(parent)[0]
    assert final.step == 90
    assert lineage.client.get_run(final.run_id).data.tags[TAG_SEGMENT] == "2"

    assert_same_bits(restarted, final_state(lineage, parent, tmp_path / "f", [90, 30]))
    assert workload_processes(relay_home) == {}, "no workload may outlive its DAG run"
    assert _leased_to(parent) == [], "the next DAG run gets the nodes back"
