"""Where a DAG run's start-up goes under ``airflow dags test``: run start -> first step done.

Like :mod:`relay.lineage.resume_time`, a chain of wall-clock marks (this machine's
clock), each closing one part, so the parts add up to the start-up:

- ``airflow_cli``: the runner started ``airflow dags test`` -> its first log line
  (the interpreter and Airflow's command line imported);
- ``dag_parse_and_sync``: -> Airflow "creating dag run" (the DAG folder parsed and
  written to Airflow's database, twice: the command, then ``dag.test`` re-syncs);
- ``dag_run_created``: -> "[DAG TEST] starting task_id=preflight";
- ``task_runner``: -> Relay's preflight started (``preflight.json``; Airflow's
  in-process execution API built for the first task, the task runner, the plugins);
- ``preflight``: Relay's preflight (spec, policy, entrypoint check, MLflow imported and
  the DAG run's MLflow run opened, the first segment's agents warmed);
- ``segment_task``: preflight ended -> the first segment's task started (``task.json``);
- ``launch``, ``agent_start``, ``rendezvous``, ``first_step``: as in
  :mod:`relay.lineage.resume_time`, from the first attempt's folder.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from relay.lineage.resume_time import PREFLIGHT_FILE, retry_marks

STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")
LOG_MARKS = (  # (the part a log line closes, the line's pattern)
    ("airflow_cli", r"Z \["),  # Airflow's first structured log line
    ("dag_parse_and_sync", r"creating dag run"),
    ("dag_run_created", r"\[DAG TEST\] starting task_id=preflight"),
)
PARTS = ("airflow_cli", "dag_parse_and_sync", "dag_run_created", "task_runner", "preflight",
         "segment_task", "launch", "agent_start", "rendezvous", "first_step")


def stamp(lines: list[str], pattern: str, last: bool = False) -> float | None:
    """Return the time of the first (or last) log line matching ``pattern``."""
    hits = [line for line in lines if re.search(pattern, line)]
    match = STAMP.match(hits[-1] if last else hits[0]) if hits else None
    return datetime.fromisoformat(match.group(1) + "+00:00").timestamp() if match else None


def startup_marks(started: float, log_file: Path, run_dir: Path) -> dict[str, float]:
    """Return the marks found (a part's name -> when it ended), ``start`` first."""
    lines = log_file.read_text(errors="replace").splitlines() if log_file.exists() else []
    marks = {"start": started}
    for part, pattern in LOG_MARKS:
        at = stamp(lines, pattern)
        if at is not None:
            marks[part] = at
    try:
        preflight = json.loads((run_dir / PREFLIGHT_FILE).read_text())
        marks.update(task_runner=float(preflight["started_at"]),
                     preflight=float(preflight["ended_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    first = run_dir / "segment-000" / "try-1"
    found = retry_marks(first) or {}
    for part, key in (("segment_task", "retry_scheduling"), ("launch", "launch"),
                      ("agent_start", "agent_start"), ("rendezvous", "rendezvous"),
                      ("first_step", "first_step")):
        if key in found:
            marks[part] = float(found[key])
    return marks


def startup_parts(started: float, log_file: Path, run_dir: Path) -> dict[str, float | None]:
    """Return each part's seconds (None: its mark or the one before it is missing)."""
    marks = startup_marks(started, log_file, run_dir)
    parts: dict[str, float | None] = {}
    last: float | None = marks["start"]
    for part in PARTS:
        at = marks.get(part)
        parts[part] = None if at is None or last is None else round(at - last, 2)
        last = at
    return parts


def format_parts(parts: dict[str, float | None]) -> str:
    """Return ``total = airflow_cli 2.1s + ...`` (total only when every part is known)."""
    known = [s for s in parts.values() if s is not None]
    total = f"{sum(known):.2f}s" if len(known) == len(parts) else "incomplete"
    return total + " = " + " + ".join(
        f"{p} {'?' if s is None else f'{s:.2f}s'}" for p, s in parts.items())
