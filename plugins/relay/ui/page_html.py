"""HTML of the Recovery page (server-rendered, no scripts; every value escaped)."""

from __future__ import annotations

import json
import time
from html import escape
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from relay.core.attempt import AttemptState

if TYPE_CHECKING:  # run_view imports MLflow: the plugin loads this module in every component
    from relay.lineage.run_view import AttemptView, RunView

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left;font-size:13px;vertical-align:top}th{background:#f3f3f3}
.fault{border-left:4px solid #d1495b;padding:.3em .8em;margin:.6em 0;background:#fff6f6}
.ok{color:#3a9d5d}.bad{color:#d1495b}.muted{color:#777}pre{background:#f6f6f6;padding:.5em;
overflow:auto;font-size:12px;max-height:20em}.bar{background:#eee;height:14px;width:400px}
.bar div{background:#2e86de;height:14px}img{max-width:100%;border:1px solid #ddd}
"""


def _t(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + " UTC"


def _s(sec: float | None) -> str:
    return "-" if sec is None else f"{sec:.1f}s"


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def run_link(dag_id: str, run_id: str) -> str:
    """Return the page URL of one DAG run (relative to ``/relay/``)."""
    return "run?" + urlencode({"dag_id": dag_id, "run_id": run_id})


def index_html(listing: dict[str, list[Any]]) -> str:
    """Return the list of jobs and their newest DAG runs."""
    parts = ["<h1>Relay recovery</h1>"]
    for job, runs in listing.items():
        parts.append(f"<h2>Job {escape(job)} (DAG relay_{escape(job)})</h2>")
        if not runs:
            parts.append("<p class='muted'>No runs recorded yet.</p>")
            continue
        rows = []
        for run in runs:
            tags = run.data.tags
            dag_run = tags.get("relay.dag_run_id", "")
            rows.append(
                f"<tr><td><a href='{escape(run_link('relay_' + job, dag_run))}'>"
                f"{escape(dag_run)}</a></td><td>{escape(AttemptState.from_outcome(tags.get('relay.outcome')))}"
                f"</td><td>{_t(run.info.start_time / 1000)}</td></tr>")
        parts.append("<table><tr><th>DAG run</th><th>outcome</th><th>started</th></tr>"
                     + "".join(rows) + "</table>")
    return _page("Relay recovery", "".join(parts))


def _summary(view: RunView) -> str:
    g = view.goodput
    pct = 100.0 * view.progress_step / view.total_steps if view.total_steps else 0.0
    lost = "".join(f"<tr><td>{escape(k)}</td><td>{_s(v)}</td></tr>"
                   for k, v in g["lost_seconds_by_fault"].items())
    lost = lost or "<tr><td colspan=2>none</td></tr>"
    quarantined = "".join(
        f"<tr><td>{escape(q['node'])}</td><td>{_t(q['until'])}</td><td>{escape(q['reason'])}"
        f"</td><td>{escape(q['by'])}</td></tr>" for q in view.quarantines
    ) or "<tr><td colspan=4>none</td></tr>"
    cls = {AttemptState.COMPLETED: "ok", AttemptState.RUNNING: ""}.get(view.outcome, "bad")
    return (
        f"<p>Outcome: <b class='{cls}'>{escape(view.outcome)}</b> &middot; MLflow run "
        f"<code>{escape(view.parent_run_id)}</code> &middot; started {_t(view.started_at)}"
        f" &middot; policy sha256 <code>{escape(view.policy_sha256)}</code></p>"
        f"<p>Progress: step {view.progress_step} / {view.total_steps} ({pct:.0f}%), ETA "
        f"{_s(view.eta_seconds)}</p><div class='bar'><div style='width:{pct:.0f}%'></div></div>"
        f"<h2>Goodput so far</h2><p>ETTR <b>{g['ettr']:.2f}</b>: {_s(g['productive_seconds'])}"
        f" productive of {_s(g['elapsed_seconds'])}.</p>"
        f"<table><tr><th>fault class</th><th>time lost</th></tr>{lost}</table>"
        f"<h2>Quarantined nodes</h2><table><tr><th>node</th><th>until</th><th>reason</th>"
        f"<th>by</th></tr>{quarantined}</table>"
    )


def _fault_table(view: RunView) -> str:
    rows = "".join(
        f"<tr><td>{r.segment}</td><td>{escape(r.kind)}</td><td>{escape(r.culprit)}</td>"
        f"<td>{_s(r.detected_after)}</td><td>{escape(r.decision)}</td>"
        f"<td>{'-' if r.lost_steps is None else r.lost_steps}</td>"
        f"<td>{_s(r.time_to_resume)}</td></tr>" for r in view.faults)
    return ("<h2>Faults</h2><table class='faults'><tr><th>segment</th><th>fault</th>"
            "<th>culprit</th><th>detected after</th><th>decision</th><th>lost steps</th>"
            f"<th>time to resume</th></tr>{rows or '<tr><td colspan=7>none</td></tr>'}</table>")


def _fault_detail(a: AttemptView) -> str:
    fault, decision = a.fault or {}, a.decision or {}
    evidence = dict(fault.get("evidence", {}))
    stack = evidence.pop("stack", None) or evidence.pop("stacks", None)
    stack_html = (f"<details open><summary>culprit's stack</summary><pre>"
                  f"{escape(stack if isinstance(stack, str) else json.dumps(stack, indent=1))}"
                  "</pre></details>") if stack else "<p class='muted'>No stack recorded.</p>"
    rank = fault.get("culprit_rank")
    return (
        f"<div class='fault'><b>Segment {a.segment} try {a.try_number}: "
        f"<span class='bad'>{escape(str(fault.get('kind')))}</span></b> &mdash; culprit rank "
        f"<b>{'-' if rank is None else rank}</b>, node "
        f"<b>{escape(str(fault.get('culprit_node') or '-'))}</b>, detected "
        f"{_t(fault.get('detected_at'))}<br>Evidence: {escape(str(evidence.get('summary', '')))}"
        f"<details><summary>all evidence</summary><pre>{escape(json.dumps(evidence, indent=1))}"
        f"</pre></details>{stack_html}"
        f"Decision: <b>{escape(str(decision.get('action')))}</b> by rule "
        f"<code>{escape(str(decision.get('rule')))}</code> (policy sha256 "
        f"<code>{escape(str(decision.get('policy_sha256', ''))[:16])}</code>&hellip;): "
        f"{escape(str(decision.get('reason', '')))}<br>Lost steps: {a.lost_steps}; resumes "
        f"at step {a.next_resume_step}</div>"
    )


def _attempts(view: RunView) -> str:
    parts = ["<h2>Segments and attempts</h2><table><tr><th>segment</th><th>try</th>"
             "<th>nodes</th><th>steps</th><th>outcome</th><th>started</th>"
             "<th>first step after</th><th>reached step</th></tr>"]
    for a in view.attempts:
        ready = None if a.productive_at is None else a.productive_at - a.started_at
        cls = {AttemptState.COMPLETED: "ok", AttemptState.FAULTED: "bad"}.get(a.outcome, "")
        parts.append(
            f"<tr><td>{a.segment}</td><td>{a.try_number}</td><td>{escape(', '.join(a.nodes))}"
            f"</td><td>[{a.resume_step}, {a.end_step})</td><td class='{cls}'>"
            f"{escape(a.outcome)}</td><td>{_t(a.started_at)}</td><td>{_s(ready)}</td>"
            f"<td>{'-' if a.reached_step is None else a.reached_step}</td></tr>")
    parts.append("</table>")
    return "".join(parts)


def run_html(view: RunView) -> str:
    """Return the page of one DAG run."""
    pics = "".join(
        f"<p><img alt='{name}' src='picture/{escape(view.dag_id)}/{escape(view.parent_run_id)}"
        f"/{name}.png'></p>" for name in ("timeline", "loss"))
    body = (
        f"<p><a href='./'>&larr; all runs</a></p><h1>{escape(view.dag_id)} &middot; "
        f"{escape(view.dag_run_id)}</h1>{_summary(view)}{_fault_table(view)}"
        + "".join(_fault_detail(a) for a in view.attempts if a.fault)
        + _attempts(view) + "<h2>Timeline and loss</h2>" + pics
    )
    return _page(f"Relay recovery: {view.dag_run_id}", body)
