"""The texts of Relay's Airflow notes: what a recovery did, where people look in Airflow.

Airflow 3 shows a task instance's note and a DAG run's note in its grid and run
pages. The segment task sets them (:mod:`relay.operators.airflow_notes`) from the
run's record read back from MLflow (:func:`relay.lineage.run_view.run_view`, as the
Recovery page reads it);
these pure functions write the words:

- the segment task's note, one line per fault of the segment, e.g.
  ``Recovered: hang of rank 1 on node-a at step 35 → restarted on node-b, node-c from
  step 35, 0 steps lost (rules.hang), back in 5.6s``;
- the DAG run's note: a summary of every fault of the run (count by kind, lost steps, the
  training time lost), then the same lines, each with its segment.

Airflow keeps at most :data:`NOTE_LIMIT` characters of a note; the summary comes first
and the lines that do not fit are counted instead.
"""

from __future__ import annotations

from collections import Counter

from relay.lineage.report import FaultRow

NOTE_LIMIT = 1000  # Airflow's notes: String(1000) in the metadata database


def _who(row: FaultRow) -> str:
    rank = "" if row.rank is None else f"rank {row.rank}"
    if row.node and rank:
        return f"{rank} on {row.node}"
    return rank or row.node or "the job"


def _lost(row: FaultRow) -> str:
    return "lost steps unknown" if row.lost_steps is None else f"{row.lost_steps} steps lost"


def fault_note(row: FaultRow) -> str:
    """Return one fault's line: what happened, what Relay did, what it cost."""
    at = "" if row.step is None else f" at step {row.step}"
    what = f"{row.kind} of {_who(row)}{at}"
    rule = f" ({row.rule})" if row.rule else ""
    by = f" by {row.rule}" if row.rule else ""
    if not row.retry:
        return f"Not retried: {what} → {row.decision}{by}, {_lost(row)}"
    start = "?" if row.resume_step is None else str(row.resume_step)
    if row.retry_nodes is None:
        return f"Retrying: {what} → {row.decision}{by}, from step {start}, {_lost(row)}"
    where = ", ".join(row.retry_nodes) or "?"
    line = f"Recovered: {what} → restarted on {where} from step {start}, {_lost(row)}{rule}"
    return line if row.time_to_resume is None else f"{line}, back in {row.time_to_resume:.1f}s"


def _fit(head: list[str], lines: list[str]) -> str:
    """Return ``head`` and as many ``lines`` as fit in a note, counting the rest."""
    text = ""
    for keep in range(len(lines), -1, -1):
        rest = len(lines) - keep
        tail = [f"… and {rest} more (Relay's Recovery page lists all)"] if rest else []
        text = "\n".join([*head, *lines[:keep], *tail])
        if len(text) <= NOTE_LIMIT:
            return text
    return text[:NOTE_LIMIT]


def task_note(rows: list[FaultRow], segment: int) -> str | None:
    """Return the note of a segment's task instance (None: the segment had no fault)."""
    lines = [fault_note(r) for r in rows if r.segment == segment]
    return _fit([], lines) if lines else None


def run_note(rows: list[FaultRow], time_lost_seconds: float | None = None) -> str | None:
    """Return the note of a DAG run: its faults and what they cost (None: no fault).

    ``time_lost_seconds``: the training time the faults cost (the Recovery page's "time
    lost", :meth:`relay.lineage.run_view.RunView.summary`)."""
    if not rows:
        return None
    kinds = Counter(r.kind for r in rows)
    count = ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in kinds.items())
    lost = [r.lost_steps for r in rows]
    parts = [f"{sum(x or 0 for x in lost)} steps lost" if None not in lost
             else "lost steps unknown"]
    if time_lost_seconds is not None:
        pending = sum(1 for r in rows if r.retry and r.time_to_resume is None)
        parts.append(f"{time_lost_seconds:.1f}s of training time lost"
                     + (f" so far ({pending} not resumed yet)" if pending else ""))
    given_up = sum(1 for r in rows if not r.retry)
    ended = f", {given_up} not retried" if given_up else ""
    plural = "s" if len(rows) > 1 else ""
    head = f"Relay: {len(rows)} fault{plural} ({count}){ended}; {'; '.join(parts)}"
    return _fit([head], [f"- segment {r.segment}: {fault_note(r)}" for r in rows])
