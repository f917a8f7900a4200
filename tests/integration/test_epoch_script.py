"""One DataLoader epoch script (``training/examples/epochs.py``) under Relay and without it.

Under Relay: `airflow dags test` with real MLflow and 4-rank DDP over gloo, a spec
with ``epochs``/``steps_per_epoch``, a hang and a crash that each resume inside an
epoch, final weights equal to a clean run's bit for bit. Without Relay: the same
file as one plain process (and rerun: it resumes from its newest local checkpoint),
and under plain ``torchrun`` with 2 ranks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from airflow_jobs import (
    assert_same_bits,
    fault_records,
    final_state,
    free_the_pool,
    prepare_jobs,
    run_job_ok,
)
from processes import workload_processes

from relay.core.settings import REPO_ROOT
from relay.lineage.store import Lineage
from relay_train.local import local_checkpoints

pytestmark = pytest.mark.integration

SCRIPT = REPO_ROOT / "training" / "examples" / "epochs.py"
STEPS_PER_EPOCH = 15  # 960 samples / 4 ranks / batches of 16 (drop_last)
JOB = f"""\
job: epochs
epochs: 4
steps_per_epoch: {STEPS_PER_EPOCH}
steps_per_segment: 30
checkpoint_every: 10
nodes: 2
ranks_per_node: 2
entrypoint: {{script: "{SCRIPT}", args: [--batch-size, "16"]}}
retries: 2
retry_delay: 1s
chaos: allowed
"""
FAULTS = [
    {"kind": "hang", "segment": 0, "step": 17, "rank": 2, "attempt": 1},
    {"kind": "crash", "segment": 1, "step": 47, "rank": 1, "attempt": 1},
]


def newest_state(lineage: Lineage, parent: str, where: Path) -> dict[str, Any]:
    """Load the run's step-60 checkpoint, its chain unbroken back to its first checkpoint.

    The first is step 10, or earlier: on a machine loaded far beyond its cores even the
    clean run once met a straggler, drained at step 11 and resumed there (inside epoch 0).
    """
    first = [m.step for m in lineage.chain(parent)][-1]
    assert first <= 10, first
    return final_state(lineage, parent, where, [60, first])


@pytest.fixture(scope="module")
def epochs_job(relay_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return prepare_jobs(relay_home, tmp_path_factory.mktemp("jobs"), {"epochs": JOB})


@pytest.mark.slow  # `make test-slow`
def test_epoch_script_resumes_inside_epochs_bit_for_bit(
    epochs_job: dict[str, str], relay_home: Path, tmp_path: Path
) -> None:
    lineage = Lineage.from_settings()
    clean = run_job_ok(epochs_job, relay_home, "epochs", {"chaos": []}, "epochs-clean")
    reference = newest_state(lineage, clean, tmp_path / "clean")
    free_the_pool()
    faulty = run_job_ok(epochs_job, relay_home, "epochs", {"chaos": FAULTS}, "epochs-faults")
    records = fault_records(lineage, faulty, tmp_path)
    assert sorted(records) == ["0", "1"], records
    hang, crash = records["0"], records["1"]
    # What this test is about is the data, not detection: on a machine loaded far beyond its
    # cores (load average 12 to 30 on 2) the stalled rank's node also went silent for the
    # watcher (node_unresponsive), once before the hang's step; the resume is what counts.
    assert hang["fault"]["kind"] in ("hang", "node_unresponsive"), hang["fault"]
    assert crash["fault"]["kind"] == "crash", crash["fault"]
    # The retries resume inside an epoch: the rescued step 17 (or checkpoint 10), and
    # checkpoint 40 (or the segment start 30, an epoch's start).
    resumed = [record["next_resume_step"] for record in (hang, crash)]
    assert any(step % STEPS_PER_EPOCH for step in resumed), resumed
    assert_same_bits(reference, newest_state(lineage, faulty, tmp_path / "faulty"))
    assert workload_processes(relay_home) == {}


def run_script(command: list[str], cwd: Path) -> str:
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # three interpreters with torch: ~20 s on an idle machine
def test_epoch_script_runs_as_one_plain_process_and_resumes(tmp_path: Path) -> None:
    """No Relay, no torchrun: a group of one, 60 steps an epoch, ./checkpoints."""
    first = run_script([sys.executable, str(SCRIPT), "--epochs", "1"], tmp_path)
    assert "epoch 0 loss" in first
    assert [s for s, _ in local_checkpoints(tmp_path / "checkpoints")] == [60]
    again = run_script([sys.executable, str(SCRIPT), "--epochs", "2"], tmp_path)
    assert "epoch 0 loss" not in again and "epoch 1 loss" in again  # resumed at step 60
    steps = local_checkpoints(tmp_path / "checkpoints")
    assert [s for s, _ in steps] == [100, 120]  # every 100 steps and at the end; two kept
    assert torch.load(steps[-1][1], weights_only=True)["step"] == 120


@pytest.mark.slow
def test_epoch_script_runs_under_plain_torchrun(tmp_path: Path) -> None:
    """No Relay: torchrun's environment makes the group; 30 steps an epoch per rank."""
    out = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", "2", str(SCRIPT), "--epochs", "2"], tmp_path)
    assert "epoch 1 loss" in out
    assert [s for s, _ in local_checkpoints(tmp_path / "checkpoints")] == [60]  # the end
