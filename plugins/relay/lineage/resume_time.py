"""Where a recovery's time goes: from the fault to the retry's first productive step.

**Time to resume** has one definition, :func:`time_to_resume`: from the fault's onset to
the retry's first productive step, with detection (onset -> the watcher's event) shown as
its own part. The task log, ``decision.json``, MLflow (``time_to_resume.total``), the
Recovery page and ``relay report`` all take it from there. Where the onset is unknown (a
real fault: only an injected one records when it struck), the figure starts at detection
and says so (``detect`` is None).

Every recovery is a chain of wall-clock marks, each closing one part:

- ``detect``: the fault began -> the watcher fired (only when the onset is known:
  an injected fault's strike in ``chaos.jsonl``; a real fault's onset is not);
- ``wake``: the watcher's event -> the deferred task running again;
- ``decide``: the policy's decision (and starting the standby agents);
- ``rescue``: the drain or the rescue snapshot from a healthy rank (0 if neither),
  and gathering the ranks' stack evidence (bounded by ``evidence_timeout``);
- ``stop``: stopping every process of the attempt;
- ``record``: quarantine, resume point, publishing the rescue, notifying, decision.json,
  MLflow;
- ``retry_scheduling``: the task failing -> Airflow running the retry (backoff included);
- ``launch``: the retry finding its checkpoint, opening its MLflow run, writing the launch;
- ``agent_start``: the launch -> rank 0 forked (a standby agent claimed, or an agent started);
- ``rendezvous``: rank 0 forked -> its process group joined (imports included; through
  ``session.init_process_group()``: a script that joins on its own counts it in
  ``first_step``);
- ``first_step``: checkpoint restore, model and DDP set-up, the first step.

The faulty attempt's task records the marks up to ``record`` in its
``decision.json``; the retry's task completes them from its own attempt folder
once it ends (its ``task.json``, the launcher's handle and rank 0's
``first_step.json``), rewrites that ``decision.json`` and logs the whole
breakdown to the faulty attempt's MLflow run (``time_to_resume.json`` and
``time_to_resume.*`` metrics). Parts are differences of consecutive marks, so
they add up to the total by construction; all marks are this machine's clock.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.core.attempt import Attempt
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.injection import CHAOS_LOG
from relay_train.protocol.launch import FIRST_STEP_FILE, LAUNCH_FILE, LaunchConfig

PREFLIGHT_FILE = "preflight.json"  # in a DAG run's folder: when preflight started and ended

log = logging.getLogger(__name__)

PARTS = ("detect", "wake", "decide", "rescue", "stop", "record", "retry_scheduling", "launch",
         "agent_start", "rendezvous", "first_step")
TASK_FILE = "task.json"  # written by the segment task: when it started, when it launched
KEY = "time_to_resume"


@dataclass(frozen=True)
class TimeToResume:
    """One fault's time to resume, in seconds: ``total`` = ``detect`` + ``after_detection``.

    ``detect``: onset -> the watcher's event (None: onset unknown);
    ``after_detection``: the event -> the retry's first productive step (None: not yet);
    ``total``: onset -> that first step (from the event when the onset is unknown).
    """

    detect: float | None
    after_detection: float | None

    @property
    def total(self) -> float | None:
        """Return onset -> first productive step (None before that step)."""
        if self.after_detection is None:
            return None
        return round((self.detect or 0.0) + self.after_detection, 3)

    def describe(self) -> str:
        """Return e.g. ``5.6s (detection 2.0s + 3.6s to the first step)``."""
        total = self.total
        if total is None:
            return "not resumed yet"
        if self.detect is None:
            return f"{total:.1f}s from detection (onset unknown)"
        return f"{total:.1f}s (detection {self.detect:.1f}s + {self.after_detection:.1f}s)"


def time_to_resume(onset: float | None, detected_at: float,
                   first_step_at: float | None) -> TimeToResume:
    """Return a fault's time to resume: its onset (None: unknown), the watcher's event, and
    the retry's first productive step (None: not reached yet)."""
    detect = None if onset is None else round(detected_at - onset, 3)
    after = None if first_step_at is None else round(first_step_at - detected_at, 3)
    return TimeToResume(detect, after)


def from_breakdown(marks: dict[str, float], onset_known: bool) -> TimeToResume:
    """Return the time to resume of a breakdown's marks (as in decision.json)."""
    return time_to_resume(marks["onset"] if onset_known else None, marks["detect"],
                          marks.get("first_step"))


def fault_onset(attempt_dir: Path) -> float | None:
    """Return when the injected fault struck (the first strike in chaos.jsonl), if any."""
    path = attempt_dir / CHAOS_LOG
    if not path.exists():
        return None
    times = [json.loads(line)["at"] for line in path.read_text().splitlines() if line.strip()]
    return min(times) if times else None


class ResumeClock:
    """The marks of one recovery, as the faulty attempt's task sees them."""

    def __init__(self, onset: float | None, detected_at: float, woke_at: float) -> None:
        self.marks: dict[str, float] = {"onset": onset if onset is not None else detected_at,
                                        "detect": detected_at, "wake": woke_at}
        self.onset_known = onset is not None

    def mark(self, part: str, at: float) -> None:
        """Close ``part`` at ``at`` (``time.time()``)."""
        if part not in PARTS:
            raise ValueError(f"time to resume part: expected one of {PARTS}, found {part!r}")
        self.marks[part] = at

    def to_dict(self) -> dict[str, Any]:
        """Return the breakdown as recorded in decision.json."""
        return breakdown(self.marks, self.onset_known)


def breakdown(marks: dict[str, float], onset_known: bool, **extra: Any) -> dict[str, Any]:  # noqa: ANN401
    """Return marks, the parts between consecutive known marks, and the total once complete."""
    parts: dict[str, float | None] = {}
    last = marks["onset"]
    for part in PARTS:
        if part not in marks:
            break
        parts[part] = round(marks[part] - last, 3)
        last = marks[part]
    if not onset_known:
        parts["detect"] = None  # onset unknown: the breakdown starts at detection
    complete = all(p in marks for p in PARTS)
    total = from_breakdown(marks, onset_known).total if complete else None
    return {"marks": marks, "onset": "injected fault's strike" if onset_known else "unknown",
            "parts": parts, "total": total, "complete": complete, **extra}


def note_launch(attempt_dir: Path, task_started_at: float, launch_called_at: float) -> None:
    """Record when the segment task started and when it called the launcher."""
    write_atomically(attempt_dir / TASK_FILE, json.dumps(
        {"task_started_at": task_started_at, "launch_called_at": launch_called_at}))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _agent_start_kind(attempt_dir: Path, first: dict[str, Any]) -> str:
    handle = _read(attempt_dir / "handle.json") or {}
    node = first.get("node")
    entry = handle.get("nodes", {}).get(node, {}) if node else {}
    return "standby claim" if entry.get("standby") else "agent start"


def retry_marks(attempt_dir: Path) -> dict[str, Any] | None:
    """Return the retry's marks from its attempt folder (None before its first step)."""
    task, first = _read(attempt_dir / TASK_FILE), _read(attempt_dir / FIRST_STEP_FILE)
    if task is None or first is None or "spawned_at" not in first:
        return None
    startup = first.get("startup", {})
    joined = first["spawned_at"] + startup.get("imports", 0.0) + startup.get("rendezvous", 0.0)
    return {
        "retry_scheduling": task["task_started_at"], "launch": task["launch_called_at"],
        "agent_start": first["spawned_at"], "rendezvous": joined, "first_step": first["at"],
        "agent_start_kind": _agent_start_kind(attempt_dir, first),
    }


def complete_previous(attempt_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """Complete the breakdown of the recovery that led to this attempt; return it if done."""
    try:
        number = int(attempt_dir.name.removeprefix("try-"))
    except ValueError:
        return None
    previous = attempt_dir.with_name(f"try-{number - 1}") / "decision.json"
    record = _read(previous)
    if record is None or KEY not in record or record[KEY].get("complete"):
        return None
    found = retry_marks(attempt_dir)
    if found is None:
        log.info("Time to resume of %s not complete: %s never reached its first step",
                 previous.parent, attempt_dir)
        return None
    kind = found.pop("agent_start_kind")
    marks = {**record[KEY]["marks"], **found}
    record[KEY] = breakdown(marks, record[KEY]["onset"] != "unknown", agent_start=kind)
    write_atomically(previous, json.dumps(record, indent=2, default=str))
    return previous.parent, record[KEY]


def finish_previous(lineage: Any, attempt_dir: Path,  # noqa: ANN401
                    run_id_of: Callable[[Attempt], str] | None = None) -> Path | None:
    """Complete the breakdown of the recovery that started the attempt in ``attempt_dir``,
    and log it to the faulty attempt's MLflow run (``run_id_of``: how to find an attempt's
    run, where a launcher's handovers move it; default: its launch file's). Return the
    faulty attempt's folder once its breakdown is complete (else None). Never raises:
    a report must not fail the segment."""
    previous = None
    try:
        done = complete_previous(attempt_dir)
        if done is not None:
            previous, result = done
            run_id = (run_id_of(Attempt(previous)) if run_id_of is not None
                      else LaunchConfig.read(previous / LAUNCH_FILE).run_id)
            log_to_mlflow(lineage, run_id, result)
            found = from_breakdown(result["marks"], result["onset"] != "unknown")
            log.info("Time to resume after %s: %s", previous, found.describe())
    except Exception:  # noqa: BLE001 - a report must never fail the segment
        log.exception("Could not record the time to resume of the previous attempt")
    return previous


def log_to_mlflow(lineage: Any, run_id: str, result: dict[str, Any]) -> None:  # noqa: ANN401
    """Log a complete breakdown to the faulty attempt's MLflow run."""
    from mlflow.entities import Metric

    lineage.log_json(run_id, f"{KEY}.json", result)
    now = int(result["marks"]["first_step"] * 1000)
    metrics = [Metric(f"{KEY}.{part}", float(seconds), now, 0)
               for part, seconds in result["parts"].items() if seconds is not None]
    metrics.append(Metric(f"{KEY}.total", float(result["total"]), now, 0))
    lineage.client.log_batch(run_id, metrics=metrics)


def format_parts(parts: dict[str, float | None]) -> str:
    """Return e.g. ``detect 3.1s + wake 0.9s + ...``."""
    return " + ".join(f"{p} {'?' if s is None else f'{s:.1f}s'}" for p, s in parts.items())


def preflight_started_at(run_dir: Path) -> float | None:
    """Return when a DAG run's preflight task started: Relay's first line in the run,
    Airflow's work before it (None if preflight never finished)."""
    path = run_dir / PREFLIGHT_FILE
    return float(json.loads(path.read_text())["started_at"]) if path.exists() else None
