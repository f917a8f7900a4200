"""`relay bench resume`: fault -> first productive step for a stalled rank and a frozen node,
run after run, Relay only.

Each run is goodput's job (2 nodes x 2 ranks from a pool of 5, real DDP over gloo),
shorter (default 240 steps in one segment), through ``airflow dags test`` as
`relay bench goodput` runs Relay, with the first two faults of goodput's schedule:
a stalled rank (rank position 1) and a frozen node (SIGSTOP of the agent and ranks of
the node hosting rank position 2). No torchrun baseline and no straggler: this bench is
for the time to resume of the two faults issue 32 sets a goal for (median at most 2 s),
so it prints every run's figure and its parts (decision.json ``time_to_resume``), the
median per kind and per part, and the host's load average before and after::

    .venv/bin/relay bench resume [--runs 5] [--steps 240] [--keep DIR]
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from relay.tools.bench.goodput import (
    Run,
    _job_yaml,
    fault_schedule,
    prepare_home,
    refuse_keep,
    run_relay,
)
from relay.tools.bench.goodput_report import (
    format_parts,
    print_breakdown,
    sec_text,
    toward_goal,
    verdict,
)

GOAL_SECONDS = 2.0  # issue 32: fault -> first productive step, median per kind
KINDS = ("hang", "node_unresponsive")  # what the two faults are recorded as


def schedule(steps: int) -> list[dict[str, Any]]:
    """Return goodput's stalled rank and frozen node for a job of ``steps`` steps."""
    return [f for f in fault_schedule(steps) if f["kind"] in ("hang", "stop_node")]


def load_text() -> str:
    """Return the host's load averages as ``uptime`` prints them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPU(s)"


def run_line(index: int, run: Run) -> str:
    """Return one run's line: its wall time and, per fault, detection and time to resume."""
    faults = "; ".join(
        f"{f['kind']} {sec_text(f['fault_to_resume'])} (detected after "
        f"{sec_text(f['detected_after'])}, lost {f['lost_steps']})" for f in run.faults)
    return (f"  run {index}: {'ok' if run.ok else 'FAILED'}, {run.wall:.1f}s, "
            f"{run.attempts} tries; {faults or 'no recovery recorded'}")


def per_kind(runs: list[Run]) -> dict[str, list[float]]:
    """Return each kind's fault -> first productive step over the runs (a run's false alarm
    of the same kind, with no onset, has no figure and is left out)."""
    found: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for run in runs:
        for f in run.faults:
            if f["kind"] in found and f["detected_after"] is not None \
                    and f["fault_to_resume"] is not None:
                found[f["kind"]].append(float(f["fault_to_resume"]))
    return found


def print_summary(runs: list[Run]) -> None:
    """Print the median per kind against the goal, and the median of every part."""
    print(f"\n  Fault -> first productive step over {len(runs)} run(s), each figure cut up to "
          "1 decimal (towards missing the goal):")
    for kind, values in per_kind(runs).items():
        median = f"median {statistics.median(values):.2f}s" if values else "no figure"
        print(f"  {kind:18} {' / '.join(toward_goal(v, 1, False) + 's' for v in values)}: "
              f"{median}; goal <= {GOAL_SECONDS:g}s "
              f"{verdict(values, lambda v: v <= GOAL_SECONDS)}")
    print_breakdown([[run] for run in runs])
    others = sorted({f["kind"] for run in runs for f in run.faults} - set(KINDS))
    if others:
        print(f"  Also recovered (not injected here: false alarms): {', '.join(others)}")


def main(runs: int = 5, steps: int = 240, every: int = 20, keep: Path | None = None) -> int:
    """Run the job ``runs`` times with the two faults; print each run, then the medians."""
    if refuse_keep("resume", keep):
        return 2
    faults = schedule(steps)
    print(f"Time-to-resume benchmark: {runs} run(s) of {steps} steps in one segment, checkpoint "
          f"every {every}, 2 nodes x 2 ranks from a pool of 5, airflow dags test; stalled rank 1 "
          f"at step {faults[0]['step']}, frozen node hosting rank 2 at step {faults[1]['step']}"
          f"\n  before: {load_text()}", flush=True)
    done: list[Run] = []
    with (contextlib.nullcontext(str(keep)) if keep is not None
          else tempfile.TemporaryDirectory(prefix="relay-bench-resume-")) as tmp:
        home = Path(tmp)
        home.mkdir(parents=True, exist_ok=True)
        prepare_home(home, _job_yaml(steps, steps, every))
        for index in range(1, runs + 1):
            run, _ = run_relay(home, faults, f"run {index}")
            done.append(run)
            print(run_line(index, run), flush=True)
            for f in run.faults:
                if f.get("parts"):
                    print(f"    {f['kind']}: {format_parts(f['parts'], 2)}", flush=True)
    print(f"  after: {load_text()}")
    print_summary(done)
    return 0 if all(run.ok for run in done) else 1
