"""`relay demo --launcher slurm`: the demo job and its three faults on the Slurm test bed.

Five hosts node1..node5 that cannot read Relay's disk (RELAY_HOME hidden in each), a real
Slurm cluster, an MLflow server in the root namespace on the bridge: each fault is detected
with its kind and culprit, 0 steps are lost, every retry resumes from a checkpoint its
ranks fetched from MLflow over HTTP, and the final weights equal a fault-free run's bit for
bit (relay verify's comparison).

Kept cheap for CI: the demo job cut to its three faulty segments (180 of its 240 steps),
and the fault-free reference run by the local launcher (simulated nodes, no test bed, no
lease held) instead of a second Slurm run: both run the same spec's ranks, one intra-op
thread each (OMP_NUM_THREADS=1) over gloo with the same world size, so the reference's
bits do not depend on where the ranks ran; a difference would fail the comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow_jobs import free_the_pool, prepare_jobs, run_job_ok

from relay.core import settings
from relay.lineage.report import fault_rows, final_state, format_fault_table
from relay.lineage.store import TAG_SEGMENT, TAG_TRY, Lineage
from relay.spec.job import load_job_spec
from relay.tools.airflow_env import airflow_env
from relay.tools.demo import DEMO_FAULTS, run_once
from relay.tools.demo_slurm import on_slurm, slurm_faults
from relay.tools.testbed import slurm
from relay.tools.verify import verdict

# cluster_ns: `make test-cluster` (CI's .ci/run).
pytestmark = pytest.mark.cluster_ns

# The demo's three faults are in its segments 0, 1 and 2 (60 steps each): its fourth,
# fault-free segment is left out here.
STEPS = ("total_steps: 240", "total_steps: 180")


def _three_segments(folder: Path) -> Path:
    """Write the demo's spec cut to its first three segments into ``folder``."""
    text = (settings.jobs_dir() / "demo.yaml").read_text()
    assert STEPS[0] in text, f"dags/jobs/demo.yaml: expected {STEPS[0]!r}; the test cuts it"
    folder.mkdir(parents=True)
    path = folder / "demo.yaml"
    path.write_text(text.replace(*STEPS))
    return path


def test_the_demo_on_slurm_recovers_its_three_faults_bit_exact(
        relay_home: Path, tmp_path: Path) -> None:
    """Took 504 s on this 2-core machine at load average 7-15 and 225 s at load 1-4
    (2026-12-07): the local reference 185 s / 66 s, the Slurm run with faults 215 s /
    128 s (docs/testing.md)."""
    if slurm.can_run_slurm():
        pytest.skip(slurm.can_run_slurm())
    local = _three_segments(tmp_path / "local")
    env = prepare_jobs(relay_home, local.parent, {})
    reference = run_job_ok(env, relay_home, "demo", {"chaos": []}, "reference")
    a = final_state(Lineage.from_settings(), reference, tmp_path / "reference")
    faults = slurm_faults(DEMO_FAULTS)
    with on_slurm(relay_home, local) as spec_file:
        free_the_pool()  # the bed's nodes, all healthy
        faulty = run_once(load_job_spec(spec_file), {"chaos": [f["chaos"] for f in faults]},
                          airflow_env(relay_home), "with faults")
        assert faulty is not None, "the DAG run with faults failed (its log is printed above)"
        lineage = Lineage.from_settings()
        rows = fault_rows(lineage, faulty)
        print(format_fault_table(rows), flush=True)
        b = final_state(lineage, faulty, tmp_path / "faulty")
        # Every attempt but the frozen node's: its agents all answered Relay's stop, so
        # each stopped its ranks and sent their logs before its job ended.
        frozen = {(str(r.segment), str(r.try_number)) for r in rows
                  if r.kind == "node_unresponsive"}
        tries = {(c.data.tags.get(TAG_SEGMENT), c.data.tags.get(TAG_TRY)): c
                 for c in lineage.child_runs(faulty)}
        attempts = [c for key, c in tries.items() if key not in frozen]
        # Where each retry really resumed (0 lost steps is the decision's word for it).
        resumed = [tries[(str(r.segment), str(r.try_number + 1))].data.params.get("resume_step")
                   for r in rows]
        shipped = {(c.info.run_id, f.path) for c in attempts
                   for f in lineage.client.list_artifacts(c.info.run_id, "logs")}
        expected = {(c.info.run_id, f"logs/{n}") for c in attempts
                    for n in c.data.params["nodes"].split(",")}

    found = [(r.segment, r.kind, r.rank, r.node, r.lost_steps) for r in rows]
    assert found == [(0, "hang", 1, "node1", 0), (1, "node_unresponsive", None, "node2", 0),
                     (2, "straggler", 3, "node4", 0)], found
    assert all(r.detected_after is not None and r.time_to_resume is not None for r in rows), \
        rows  # the chaos log and the first steps came back over the channel
    assert all(r.resume_step for r in rows), rows  # each retry resumed from a checkpoint
    assert resumed == [str(r.resume_step) for r in rows], (resumed, rows)  # the one decided
    assert a is not None and b is not None
    assert b["step"] == 180, b["step"]
    exact, lines = verdict(a, b)
    assert exact, lines
    # Rank logs in MLflow from every node of those attempts (the frozen node's attempt
    # sends none: its frozen agent cannot answer the stop, so Slurm's signals end it).
    assert len(attempts) == 5 and shipped == expected, (shipped, expected)
