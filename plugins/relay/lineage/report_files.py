"""`relay report`: a DAG run's timeline and loss curve as PNGs, its fault table as text and JSON."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from relay.core.attempt import AttemptState
from relay.lineage.report import format_fault_table
from relay.lineage.run_view import AttemptView, RunView, find_parent, run_view
from relay.lineage.store import Lineage

log = logging.getLogger(__name__)

TIMELINE_PNG = "timeline.png"
LOSS_PNG = "loss.png"
THROUGHPUT_PNG = "throughput.png"
STEP_SECONDS = "step_seconds"  # rank 0's smoothed step time, logged with the loss
HALF_WIDTH = (6.4, 3.8)  # inches: the loss and throughput pictures sit side by side
TABLE_TXT = "faults.txt"
REPORT_JSON = "report.json"
MLFLOW_DIR = "report"
OUTCOME_COLOURS = {AttemptState.COMPLETED: "#3a9d5d", AttemptState.FAULTED: "#d1495b",
                   AttemptState.RUNNING: "#2e86de", AttemptState.ABANDONED: "#9a9a9a",
                   AttemptState.FAILED: "#8e6c8a"}


def _figure(width: float, height: float) -> Any:  # noqa: ANN401 - a matplotlib Figure
    """Return a new figure, outside pyplot: pyplot keeps every open figure in global
    state that is not thread-safe, and the Recovery page draws in the API server's
    threads (matplotlib's advice for web servers: use ``Figure`` directly)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def plot_timeline(view: RunView, path: Path) -> Path:
    """Draw segments and attempts across nodes; faults marked, time lost shaded."""
    t0 = view.started_at
    nodes = sorted({n for a in view.attempts for n in a.nodes})
    row = {n: i for i, n in enumerate(nodes)}
    fig = _figure(10, 1.2 + 0.55 * max(len(nodes), 1))
    ax = fig.subplots()
    now = max([view.ended_at or 0.0, *(a.ended_at or a.started_at for a in view.attempts)])
    for a in view.attempts:
        end = (a.ended_at or now) - t0
        colour = OUTCOME_COLOURS.get(a.outcome, "#555555")
        for node in a.nodes:
            y = row[node]
            ax.barh(y, end - (a.started_at - t0), left=a.started_at - t0, height=0.6,
                    color=colour, alpha=0.35, edgecolor=colour)
            if a.productive_at is not None:  # the attempt's productive part, solid
                ax.barh(y, end - (a.productive_at - t0), left=a.productive_at - t0,
                        height=0.6, color=colour)
            ax.text(a.started_at - t0 + 0.3, y, f"s{a.segment} t{a.try_number}",
                    va="center", fontsize=7, color="black")
        if a.fault is not None:
            _mark_fault(ax, view, a, row, t0, now)
    ax.set_xlim(left=0)
    ax.set_yticks(range(len(nodes)), nodes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the DAG run started")
    ax.set_title(f"{view.dag_id} / {view.dag_run_id}: attempts by node "
                 "(pale = starting, solid = training, x = fault, shaded = time lost)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _mark_fault(ax: Any, view: RunView, a: Any, row: dict[str, int],  # noqa: ANN401
                t0: float, now: float) -> None:
    fault = a.fault
    detected = fault["detected_at"] - t0
    culprit = fault.get("culprit_node")
    for node in ([culprit] if culprit in row else a.nodes):
        ax.plot(detected, row[node], marker="x", color="black", markersize=11, mew=2.5)
    ax.annotate(fault["kind"], (detected, row.get(culprit, row[a.nodes[0]])),
                xytext=(4, -12), textcoords="offset points", fontsize=8, color="#a00000")
    delay = next((r.detected_after for r in view.faults
                  if r.segment == a.segment and r.detected_after is not None), 0.0)
    retry = [x.productive_at for x in view.attempts if x.segment == a.segment
             and x.try_number > a.try_number and x.productive_at is not None]
    resumed = (min(retry) if retry else now) - t0
    ax.axvspan(detected - (delay or 0.0), resumed, color="#d1495b", alpha=0.12, lw=0)


def _label(a: AttemptView) -> tuple[str, str]:
    """Return an attempt's legend label and line style (a faulty one dashed)."""
    label = f"segment {a.segment} try {a.try_number}"
    return (label + f" ({a.fault['kind']})", "--") if a.fault is not None else (label, "-")


def plot_loss(view: RunView, lineage: Lineage, path: Path) -> Path:
    """Draw the loss against the step, one line per attempt; faulty attempts dashed."""
    fig = _figure(*HALF_WIDTH)
    ax = fig.subplots()
    for a in view.attempts:
        history = sorted((m.step, m.value) for m in
                         lineage.client.get_metric_history(a.run_id, "loss"))
        if not history:
            continue
        steps, values = zip(*history, strict=True)
        label, style = _label(a)
        ax.plot(steps, values, style, marker="." if len(steps) < 40 else None, label=label)
        if a.fault is not None:
            ax.plot(steps[-1], values[-1], marker="x", color="black", markersize=9, mew=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{view.dag_run_id}: loss across attempts", fontsize=9)
    _finish(fig, ax, path)
    return path


def steps_per_second(points: list[tuple[float, float]], t0: float) -> list[tuple[float, float]]:
    """Return (seconds since ``t0``, steps/s) from (Unix time, ``step_seconds``) points,
    oldest first; a point without a positive, finite step time is left out."""
    return [(at - t0, 1.0 / sec) for at, sec in sorted(points)
            if math.isfinite(sec) and sec > 0]


def throughput_series(view: RunView, lineage: Lineage) -> dict[str, list[tuple[float, float]]]:
    """Return each attempt's throughput over the run's time (rank 0's ``step_seconds``)."""
    series = {}
    for a in view.attempts:
        history = lineage.client.get_metric_history(a.run_id, STEP_SECONDS)
        points = steps_per_second([(m.timestamp / 1000, m.value) for m in history],
                                  view.started_at)
        if points:
            series[a.run_id] = points
    return series


def plot_throughput(view: RunView, lineage: Lineage, path: Path) -> Path:
    """Draw steps/s against the run's time, one line per attempt; faulty attempts dashed."""
    fig = _figure(*HALF_WIDTH)
    ax = fig.subplots()
    series = throughput_series(view, lineage)
    for a in view.attempts:
        if a.run_id not in series:
            continue
        seconds, rates = zip(*series[a.run_id], strict=True)
        label, style = _label(a)
        ax.plot(seconds, rates, style, marker="." if len(seconds) < 40 else None, label=label)
        if a.fault is not None:
            ax.plot(seconds[-1], rates[-1], marker="x", color="black", markersize=9, mew=2)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the DAG run started")
    ax.set_ylabel("steps/s")
    ax.set_title(f"{view.dag_run_id}: throughput per attempt", fontsize=9)
    _finish(fig, ax, path)
    return path


def _finish(fig: Any, ax: Any, path: Path) -> None:  # noqa: ANN401 - matplotlib objects
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary_text(view: RunView) -> str:
    """Return the run's headline figures and the demo's fault table as text."""
    g = view.goodput
    lost = ", ".join(f"{k} {v:.1f}s" for k, v in g["lost_seconds_by_fault"].items()) or "none"
    eta = "-" if view.eta_seconds is None else f"{view.eta_seconds:.0f}s"
    lines = [
        f"{view.dag_id} {view.dag_run_id} (MLflow run {view.parent_run_id}): {view.outcome}",
        f"  progress: step {view.progress_step}/{view.total_steps}, ETA {eta}",
        f"  goodput: ETTR {g['ettr']:.2f} ({g['productive_seconds']:.1f}s productive of "
        f"{g['elapsed_seconds']:.1f}s); time lost by fault: {lost}",
        f"  policy sha256: {view.policy_sha256}",
        *checkpoint_lines(view),
        "",
        format_fault_table(view.faults) if view.faults else "  no faults",
    ]
    return "\n".join(lines) + "\n"


def checkpoint_lines(view: RunView) -> list[str]:
    """Return each attempt's checkpoint interval and why, when it was not fixed."""
    chosen = [a for a in view.attempts
              if a.checkpoint_every_reason and not a.checkpoint_every_reason.startswith("fixed")]
    if not chosen:
        return []
    return ["  checkpoint interval (checkpoint_every: auto), per attempt:",
            *(f"    segment {a.segment} try {a.try_number}: {a.checkpoint_every_reason}"
              for a in chosen)]


def render(view: RunView, lineage: Lineage, out: Path) -> list[Path]:
    """Write the PNGs, the text table and the JSON of one run into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_timeline(view, out / TIMELINE_PNG), plot_loss(view, lineage, out / LOSS_PNG),
               plot_throughput(view, lineage, out / THROUGHPUT_PNG)]
    (out / TABLE_TXT).write_text(summary_text(view))
    (out / REPORT_JSON).write_text(json.dumps(view.to_dict(), indent=2, default=str))
    return [*written, out / TABLE_TXT, out / REPORT_JSON]


def log_pictures(lineage: Lineage, parent_run_id: str, paths: list[Path]) -> None:
    """Log the PNGs to the DAG run's MLflow run under ``report/``."""
    for path in paths:
        if path.suffix == ".png":
            lineage.client.log_artifact(parent_run_id, str(path), MLFLOW_DIR)


def write_report(job: str, dag_run_id: str | None, out: Path,
                 log_to_mlflow: bool = False) -> list[Path]:
    """Build the report of one DAG run of ``job`` (the newest without ``dag_run_id``)."""
    lineage = Lineage.from_settings()
    parent = find_parent(lineage, job, dag_run_id)
    view = run_view(lineage, parent)
    written = render(view, lineage, out)
    if log_to_mlflow:
        log_pictures(lineage, parent, written)
    return written
