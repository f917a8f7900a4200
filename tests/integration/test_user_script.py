"""A user's own torchrun-style script under Relay (not the built-in model), end to end.

The script is ``training/examples/regression.py``: the plain torchrun script
``regression_plain.py`` plus the public worker API's few lines. It runs through
`airflow dags test` with real MLflow and real 4-rank DDP over gloo.
"""

from __future__ import annotations

import dataclasses
import sys
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
from processes import workload_processes

from relay.core.settings import REPO_ROOT
from relay.lineage.run_view import run_view
from relay.lineage.store import Lineage
from relay.policy.model import Detection
from relay.tools.bench.common import Store, launch_config, launched, watch
from relay_train.protocol.launch import Entrypoint

pytestmark = pytest.mark.integration

SCRIPT = REPO_ROOT / "training" / "examples" / "regression.py"
JOB = f"""\
job: user
total_steps: 90
steps_per_segment: 30
checkpoint_every: 10
nodes: 2
ranks_per_node: 2
entrypoint: {{script: "{SCRIPT}", args: [--lr, "0.02", --batch-size, "16"]}}
retries: 2
retry_delay: 1s
chaos: allowed
"""
FAULTS = [
    {"kind": "hang", "segment": 0, "step": 15, "rank": 2, "attempt": 1},
    # The script's steps take ~20 ms: the workload trains on from the step-30 boundary for
    # about a second before segment 1's task adopts it, and a node frozen before that is
    # segment 0's fault (the gap; see README "Segment boundaries"). Pacing segment 1's steps
    # (every rank alike: no straggler) puts the freeze at step 52 well after the adoption.
    {"kind": "pace", "segment": 1, "step": 30, "seconds": 0.2},
    {"kind": "stop_node", "segment": 1, "step": 52, "node": "node-a", "attempt": 1},
    {"kind": "crash", "segment": 2, "step": 75, "rank": 1, "attempt": 1},
]


@pytest.fixture(scope="module")
def user_job(relay_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return prepare_jobs(relay_home, tmp_path_factory.mktemp("jobs"), {"user": JOB})


@pytest.mark.slow  # `make test-slow`
def test_user_script_recovers_from_hang_node_and_crash_bit_for_bit(
    user_job: dict[str, str], relay_home: Path, tmp_path: Path
) -> None:
    lineage = Lineage.from_settings()
    clean = run_job_ok(user_job, relay_home, "user", {"chaos": []}, "user-clean")
    reference = final_state(lineage, clean, tmp_path / "clean", [90, 10])
    free_the_pool()  # the faults name node-a: segment 1's workload must run there
    faulty = run_job_ok(user_job, relay_home, "user", {"chaos": FAULTS}, "user-faults")
    records = fault_records(lineage, faulty, tmp_path)
    assert sorted(records) == ["0", "1", "2"], "\n".join(
        f"segment {a.segment} try {a.try_number} on {a.nodes}: {a.outcome}"
        for a in run_view(lineage, faulty).attempts)
    hang, node, crash = records["0"], records["1"], records["2"]
    assert (hang["fault"]["kind"], hang["fault"]["culprit_rank"]) == ("hang", 2)
    assert (node["fault"]["kind"], node["fault"]["culprit_node"]) == ("node_unresponsive",
                                                                      "node-a")
    assert (crash["fault"]["kind"], crash["fault"]["culprit_rank"]) == ("crash", 1)
    for record in (hang, node):  # a healthy rank handed over the script's tracked state
        assert record["rescued"] is not None, record
        assert record["lost_steps"] == 0, record
    # The crash's retry resumed from a verified checkpoint of this segment: step 70 if its
    # upload finished in the ~5 ms between the save and the crash, else the segment start.
    assert crash["next_resume_step"] in (60, 70), crash
    assert_same_bits(reference, final_state(lineage, faulty, tmp_path / "faulty", [90, 10]))
    assert workload_processes(relay_home) == {}


def _broken(store: Store, root: Path, entry: Entrypoint) -> dict[str, Any]:
    cfg = dataclasses.replace(launch_config(store, root, steps=20), entrypoint=entry)
    detection = Detection(startup_timeout=20.0)
    with launched(cfg):
        return watch(cfg, detection, timeout=90)


# Each case is a 4-rank launch (two agents importing the training stack): the user's own exit
# message, the general path, stays in `make test`; the two messages of the launch's own checks
# run in `make test-slow` (CI runs it).
@pytest.mark.parametrize("case", [pytest.param("import_error", marks=pytest.mark.slow),
                                  pytest.param("missing_file", marks=pytest.mark.slow),
                                  "exits_2"])
def test_broken_entrypoint_is_a_launch_failure_with_its_own_message(
    case: str, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    if case == "import_error":
        entry, message = Entrypoint(module="no_such_relay_user_module"), \
            "No module named no_such_relay_user_module"
    elif case == "missing_file":
        entry, message = Entrypoint(script=str(tmp_path / "absent.py")), "no such file"
    else:
        script.write_text("import sys\nprint('bad --lr: expected a number', file=sys.stderr)\n"
                          "sys.exit(2)\n")
        entry, message = Entrypoint(script=str(script)), "bad --lr: expected a number"
    event = _broken(Store(tmp_path / "mlflow"), tmp_path / "attempt", entry)
    assert event["status"] == "faulted", event
    fault = event["fault"]
    assert fault["kind"] == "launch_failure", fault
    assert message in fault["evidence"]["summary"], fault["evidence"]
    # Found from the exit itself, long before the startup timeout would have fired.
    assert "startup_timeout" not in fault["evidence"]["summary"]


def test_plain_script_runs_under_torchrun(tmp_path: Path) -> None:
    """The 'before' script of the README's diff is a real torchrun script."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT.with_name("regression_plain.py")), "--steps", "60"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 50 loss" in out.stdout
