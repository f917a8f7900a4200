"""A short segment through Airflow (issue 29 item 2): the segment task fails for good.

A real DAG run (`airflow dags test`, real MLflow, 2 nodes x 1 rank over gloo) of a
script whose rank 1 leaves its loop at step 13 of segment 1's [10, 20): the attempt
faults ``short_segment``, the default policy aborts, the task fails with the message
(rank, step reached, step expected) and is not retried although the spec allows 2
retries; ``finalize`` never runs to complain about a missing final checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow_jobs import fault_records, prepare_jobs, run_job

from relay.lineage.run_view import run_view
from relay.lineage.store import Lineage

# ~20 s through `airflow dags test`: `make test-slow` (CI runs it); the mechanism itself is
# tested in make test by test_short_segment_run.py and the policy tests.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """\
import sys
import torch
import torch.distributed as dist
import relay_train

leave_at = int(sys.argv[1])
session = relay_train.init()
session.init_process_group()
w = torch.zeros(4)
session.track(lambda: {"w": w})
if (state := session.resume_state()) is not None:
    w.copy_(state["w"])
for step in session.steps():
    g = torch.ones(4)
    with session.collective():
        dist.all_reduce(g)
    with session.update(step):
        w.add_(g)
    session.report(step, loss=float(w.sum()))
    if session.rank == 1 and step + 1 == leave_at:
        break
session.close()
"""
JOB = """\
job: shortseg
total_steps: 20
steps_per_segment: 10
checkpoint_every: 5
nodes: 2
ranks_per_node: 1
entrypoint: {{script: "{script}", args: ["13"]}}
retries: 2
retry_delay: 1s
"""


def test_a_short_segment_fails_its_task_once_with_the_message(
    relay_home: Path, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    env = prepare_jobs(relay_home, jobs, {"shortseg": JOB.format(script=script)})

    code, parent = run_job(env, relay_home, "shortseg", {}, "shortseg", timeout_seconds=400)

    log = (relay_home / "logs" / "shortseg.log").read_text()
    assert code != 0, log[-4000:]
    assert "Segment 1 fault: short_segment (node node-b, rank 1) at step " in log, log[-4000:]
    assert ("evidence: rank 1's script returned cleanly at step 13; the job expected it to "
            "train to step 20") in log, log[-4000:]
    lineage = Lineage.from_settings()
    record = fault_records(lineage, parent, tmp_path / "records")["1"]
    assert (record["fault"]["kind"], record["fault"]["culprit_rank"]) == ("short_segment", 1)
    assert (record["decision"]["action"], record["decision"]["retry"]) == ("abort", False)
    tries = [a.try_number for a in run_view(lineage, parent).attempts if a.segment == 1]
    assert tries == [1], tries  # retries: 2 in the spec, none taken
    assert "expected a final checkpoint" not in log
