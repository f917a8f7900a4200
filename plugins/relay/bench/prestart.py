"""What prestarting the run's resident agent changes in a fault-free run's start-up.

Runs the goodput benchmark's job fault-free through ``airflow dags test`` in pairs,
with Relay's runner prestarting the run's resident agent beside Airflow's start-up
(:mod:`relay.launchers.local_prestart`) and without (preflight starts it), the order
alternating from one pair to the next; prints each run's wall time, start-up (Airflow's
part until Relay's preflight started, Relay's from there to the first step done) and
wind-down::

    .venv/bin/python -m relay.bench.prestart [STEPS] [PAIRS]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from relay.airflow_env import airflow_env, ensure_airflow_db
from relay.bench.goodput import NODE_POOL, Run, _job_yaml, ends


def one_run(home: Path, env: dict[str, str], prestart: bool, name: str) -> tuple[int, str]:
    """Run the job once; return its exit code and its line."""
    from relay.demo import run_dag_test

    (home / "nodes.json").unlink(missing_ok=True)
    started = time.time()
    log = home / "logs" / f"{name}.log"
    code = run_dag_test("relay_goodput", {"chaos": []}, env, log, prestart=prestart).wait()
    wall = time.time() - started
    dag_dir = home / "runs" / "relay_goodput"
    if not dag_dir.is_dir():
        return code or 1, f"  prestart {'on ' if prestart else 'off'}  exit {code}: no DAG run; " \
            f"see {log}"
    runs = sorted(dag_dir.iterdir(), key=lambda p: p.stat().st_mtime)
    attempts = sorted(runs[-1].glob("segment-*/try-*"))
    run = Run(name, code == 0, wall, len(attempts), started=started)
    return code, (f"  prestart {'on ' if prestart else 'off'}  exit {code}  wall {wall:5.1f}s; "
                  f"{ends(run, attempts)}")


def main(steps: int = 200, pairs: int = 3) -> int:
    """Run ``pairs`` pairs; print one line per run."""
    from relay.lineage import Lineage

    home = Path(tempfile.mkdtemp(prefix="relay-bench-prestart-"))
    jobs = home / "jobs"
    jobs.mkdir()
    (jobs / "goodput.yaml").write_text(_job_yaml(steps, steps // 2, min(25, steps // 2)))
    os.environ.update({"RELAY_HOME": str(home), "RELAY_JOBS_DIR": str(jobs),
                       "RELAY_NODES": ",".join(NODE_POOL)})
    env = airflow_env(home)
    ensure_airflow_db(env, home / "logs" / "airflow-db.log")
    Lineage.from_settings().ensure_store()  # MLflow's tables too, before any clock starts
    print(f"{steps} steps in 2 segments, fault-free, {pairs} pair(s) of runs with and without "
          f"the resident agent prestarted, alternating which goes first; files under {home}",
          flush=True)
    failed = 0
    for pair in range(pairs):
        for prestart in (True, False) if pair % 2 == 0 else (False, True):
            code, line = one_run(home, env, prestart, f"pair{pair}-{'on' if prestart else 'off'}")
            failed += code != 0
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
