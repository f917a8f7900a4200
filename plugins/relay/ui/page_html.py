"""HTML of the Recovery page: Jinja2 templates (``templates/``), autoescaped, no scripts.

Everything the page shows comes from MLflow, the node pool or the request, and
anyone who can write to MLflow can write a tag or a ``decision.json``: no value is
ever formatted into markup here. Python gathers plain values; the templates
place them, and Jinja2 escapes every one. The one inline style block carries the
response's Content-Security-Policy nonce (``relay.ui.recovery_page``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from relay.core.attempt import AttemptState
from relay.ui.glossary import GLOSSARY
from relay.ui.stack_view import stacks_of

if TYPE_CHECKING:  # run_view imports MLflow: the plugin loads this module in every component
    from relay.lineage.run_view import AttemptView, RunSummary, RunView

TEMPLATES = Path(__file__).with_name("templates")
PICTURE_NAMES = ("timeline", "loss", "throughput")
REFRESH_SECONDS = 10.0  # a running run's page reloads itself, and its pictures, this often


def _t(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + " UTC"


def _s(sec: float | None) -> str:
    return "-" if sec is None else f"{sec:.1f}s"


def _or_dash(value: object) -> object:
    return "-" if value is None or value == "" else value


@cache
def _templates() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True,
                      undefined=StrictUndefined, keep_trailing_newline=False)
    env.filters.update(when=_t, secs=_s, or_dash=_or_dash)
    return env


def _render(name: str, nonce: str, **values: Any) -> str:  # noqa: ANN401
    return _templates().get_template(name).render(nonce=nonce, **values)


def run_link(dag_id: str, run_id: str) -> str:
    """Return the page URL of one DAG run (relative to ``/relay/``)."""
    return "run?" + urlencode({"dag_id": dag_id, "run_id": run_id})


def error_html(status: int, text: str, nonce: str) -> str:
    """Return an error page: a fixed ``text`` of the page's own, never the request's input."""
    return _render("error.html", nonce, title=f"Relay recovery: {status}", status=status,
                   text=text)


def index_html(listing: dict[str, list[Any]], summaries: Mapping[str, RunSummary | None],
               nonce: str) -> str:
    """Return the list of jobs and their newest DAG runs, each with its figures at a glance
    (``summaries`` by MLflow run id; None: not readable); runs with faults stand out."""
    jobs = {}
    for job, runs in listing.items():
        rows = []
        for run in runs:
            tags = run.data.tags
            dag_run = tags.get("relay.dag_run_id", "")
            summary = summaries.get(run.info.run_id)
            rows.append({"link": run_link("relay_" + job, dag_run), "dag_run": dag_run,
                         "outcome": AttemptState.from_outcome(tags.get("relay.outcome")).value,
                         "started": run.info.start_time / 1000, "summary": summary,
                         "cls": "faulted" if summary is not None and summary.faults else ""})
        jobs[job] = rows
    return _render("index.html", nonce, title="Relay recovery", listing=jobs)


def _fault_detail(a: AttemptView) -> dict[str, Any]:
    fault, decision = a.fault or {}, a.decision or {}
    evidence = dict(fault.get("evidence", {}))
    recorded = evidence.pop("stacks", None)
    recorded = evidence.pop("stack", None) if recorded is None else recorded
    threads, stack_text = stacks_of(recorded)
    return {
        "segment": a.segment, "try_number": a.try_number, "kind": str(fault.get("kind")),
        "rank": fault.get("culprit_rank"), "node": fault.get("culprit_node"),
        "detected_at": fault.get("detected_at"), "summary": str(evidence.get("summary", "")),
        "where": str(evidence.get("where", "")),
        "evidence": json.dumps(evidence, indent=1),
        "threads": threads, "stack_text": stack_text,
        "action": str(decision.get("action")), "rule": str(decision.get("rule")),
        "policy_sha256": str(decision.get("policy_sha256", ""))[:16],
        "reason": str(decision.get("reason", "")),
        "lost_steps": a.lost_steps, "next_resume_step": a.next_resume_step,
    }


def _workload(a: AttemptView) -> str:
    """Return the folder of the attempt that launched the processes ``a`` watched."""
    return a.adopted_workload or a.attempt_dir


def adoption_note(a: AttemptView, attempts: list[AttemptView]) -> str:
    """Return what an attempt's adoption means in words ("" when it neither adopted nor
    handed over): its steps are its segment's, its training processes may go on past them."""
    def name(x: AttemptView) -> str:
        return f"segment {x.segment} try {x.try_number}"

    notes = []
    if a.adopted_at is not None:
        launcher = next((x for x in attempts if x.attempt_dir and
                         x.attempt_dir == a.adopted_workload), None)
        notes.append(f"adopted at step {a.adopted_at}: took over the training processes "
                     + (f"that {name(launcher)} launched" if launcher else
                        "of an earlier segment") + ", without a restart")
    if a.handed_over_at is not None:
        nxt = min((x for x in attempts if x.adopted_at is not None and x.segment > a.segment
                   and _workload(x) == _workload(a)), key=lambda x: (x.segment, x.try_number),
                  default=None)
        went = (f", to step {a.reached_step}" if a.reached_step is not None
                and a.reached_step > a.handed_over_at else "")
        notes.append(f"handed over at step {a.handed_over_at} to "
                     + (name(nxt) if nxt else "the next segment")
                     + f", which adopted its training processes: they went on training past "
                     f"this segment's end{went}")
    return "; ".join(notes)


def _attempt_row(a: AttemptView, attempts: list[AttemptView]) -> dict[str, Any]:
    cls = {AttemptState.COMPLETED: "ok", AttemptState.FAULTED: "bad"}.get(a.outcome, "")
    reached = a.handed_over_at if a.handed_over_at is not None else a.reached_step
    return {"segment": a.segment, "try_number": a.try_number, "nodes": ", ".join(a.nodes),
            "resume_step": a.resume_step, "end_step": a.end_step, "outcome": a.outcome,
            "cls": cls, "started_at": a.started_at, "reached_step": reached,
            "ready": None if a.productive_at is None else a.productive_at - a.started_at,
            "note": adoption_note(a, attempts)}


def run_html(view: RunView, nonce: str, dag_id: str) -> str:
    """Return the page of one DAG run, opened as ``dag_id`` (the DAG the user may read,
    whose id the picture links carry: the run's own tag is anyone's to write)."""
    pct = 100.0 * view.progress_step / view.total_steps if view.total_steps else 0.0
    folder = f"picture/{quote(dag_id, safe='')}/{quote(view.parent_run_id, safe='')}"
    running = view.outcome == AttemptState.RUNNING
    return _render(
        "run.html", nonce, title=f"Relay recovery: {view.dag_run_id}", view=view, pct=pct,
        goodput=view.goodput, running=running,
        refresh=round(REFRESH_SECONDS) if running else None,
        outcome_class={AttemptState.COMPLETED: "ok", AttemptState.RUNNING: ""}.get(
            view.outcome, "bad"),
        fault_details=[_fault_detail(a) for a in view.attempts if a.fault],
        attempts=[_attempt_row(a, view.attempts) for a in view.attempts],
        pictures={name: f"{folder}/{name}.png" for name in PICTURE_NAMES},
        words=GLOSSARY,
    )
