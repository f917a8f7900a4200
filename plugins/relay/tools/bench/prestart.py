"""What prestarting the run's resident agent changes in a fault-free run's start-up.

Runs the goodput benchmark's job fault-free through ``airflow dags test`` in pairs,
with Relay's runner prestarting the run's resident agent beside Airflow's start-up
(:mod:`relay.launchers.local.prestart`) and without (preflight starts it), the order
alternating from one pair to the next; prints each run's wall time, start-up (Airflow's
part until Relay's preflight started, Relay's from there to the first step done) and
wind-down::

    .venv/bin/python -m relay.tools.bench.prestart [STEPS] [PAIRS]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from relay.tools.bench.goodput import _job_yaml, ends, prepare_home, run_relay


def one_run(home: Path, prestart: bool, name: str) -> tuple[bool, str]:
    """Run the job once; return whether it succeeded, and its line."""
    run, attempts = run_relay(home, [], name, prestart=prestart)
    outcome = ends(run, attempts) if attempts else \
        f"no DAG run; see {home / 'logs' / (name + '.log')}"
    return run.ok, (f"  prestart {'on ' if prestart else 'off'}  exit "
                    f"{'0' if run.ok else 'non-zero'}  wall {run.wall:5.1f}s; {outcome}")


def main(steps: int = 200, pairs: int = 3) -> int:
    """Run ``pairs`` pairs; print one line per run."""
    home = Path(tempfile.mkdtemp(prefix="relay-bench-prestart-"))
    prepare_home(home, _job_yaml(steps, steps // 2, min(25, steps // 2)))
    print(f"{steps} steps in 2 segments, fault-free, {pairs} pair(s) of runs with and without "
          f"the resident agent prestarted, alternating which goes first; files under {home}",
          flush=True)
    failed = 0
    for pair in range(pairs):
        for prestart in (True, False) if pair % 2 == 0 else (False, True):
            ok, line = one_run(home, prestart, f"pair{pair}-{'on' if prestart else 'off'}")
            failed += not ok
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
