"""What the end of a fault-free run costs, after rank 0's training loop ended.

Runs the goodput benchmark's job fault-free through ``airflow dags test`` (as
:func:`relay.tools.bench.goodput.run_relay` does; shorter by default) and prints, relative to
the loop's end (rank 0's ``result.json``), when the last checkpoint was published, the
watcher's trigger completed, the last workload's stop began, the last segment's task and
``finalize`` ended, Airflow logged "DagRun Finished", and the process exited::

    .venv/bin/python -m relay.tools.bench.run_end [STEPS] [STEPS_PER_SEGMENT] [CHECKPOINT_EVERY]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from relay.tools.airflow_env import airflow_env, ensure_airflow_db
from relay.tools.bench.goodput import NODE_POOL, _job_yaml
from relay.tools.bench.startup_time import stamp

MARKS = [  # (what, pattern in the airflow dags test log, its last occurrence?)
    ("trigger completed", r"\[DAG TEST\] Trigger completed", True),
    ("stop of the last workload", r"Stopping process groups", True),
    ("last segment task ended", r"end task task_id=segment_", True),
    ("finalize started", r"starting task_id=finalize", False),
    ("finalize ended", r"end task task_id=finalize", True),
    ("DagRun Finished", r"DagRun Finished", False),
]


def main(steps: int = 400, segment: int = 200, every: int = 25) -> int:
    """Run the job once, fault-free; print the end-of-run timeline."""
    from relay.tools.demo import run_dag_test

    home = Path(tempfile.mkdtemp(prefix="relay-run-end-"))
    jobs = home / "jobs"
    jobs.mkdir()
    (jobs / "goodput.yaml").write_text(_job_yaml(steps, segment, every))
    os.environ.update({"RELAY_HOME": str(home), "RELAY_JOBS_DIR": str(jobs),
                       "RELAY_NODES": ",".join(NODE_POOL)})
    env = airflow_env(home)
    ensure_airflow_db(env, home / "logs" / "airflow-db.log")
    log_file = home / "logs" / "run.log"
    started = time.time()
    code = run_dag_test("relay_goodput", {"chaos": []}, env, log_file).wait()
    exited = time.time()
    results = sorted(home.glob("runs/relay_goodput/*/segment-*/try-*/result.json"))
    print(f"{steps} steps, segments of {segment}, checkpoint every {every}: exit code {code}, "
          f"wall {exited - started:.1f}s; files under {home}")
    if not results:
        print("no result.json: the run did not finish its training loop")
        return 1
    result = json.loads(results[-1].read_text())
    lines = log_file.read_text(errors="replace").splitlines()
    end = result["loop_ended_at"]
    rows = [("last checkpoint published", result.get("published_at"))]
    rows += [(what, stamp(lines, pattern, last)) for what, pattern, last in MARKS]
    rows.append(("airflow dags test exited", exited))
    for what, at in rows:
        print(f"  {what:28s} {f'{at - end:+7.2f}s' if at else '    n/a'}")
    return code


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:4])))
