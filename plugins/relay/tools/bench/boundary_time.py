"""What a segment boundary costs: the breakdown, from a DAG run's attempt folders.

Like :mod:`relay.lineage.resume_time` for recoveries, a boundary is a chain of
wall-clock marks (this machine's clock), so its parts add up to its total.

A **restart** boundary (``segment_boundary: restart``, or a segment whose
task could not adopt) stops the training loop at the segment's end and starts
a fresh workload; the loop is idle from its last step to the next attempt's
first step:

- ``final_checkpoint``: rank 0's loop ended -> its last checkpoint is in MLflow
  (``result.json``);
- ``exit_and_detect``: -> the watcher saw the workload end and the deferred
  task ran again (``boundary.json``);
- ``wake``: 0 here (the watcher's completed event carries no time of its own);
- ``stop_and_record``: stopping the processes, closing the MLflow run;
- ``scheduling``: the task's end -> Airflow starting the next segment's task;
- ``launch``, ``agent_start``, ``rendezvous``, ``first_step``: as in
  :mod:`relay.lineage.resume_time`.

An **adopt** boundary never stops the loop: what it costs is the loop's own
stall at the boundary step (rank 0's ``boundaries.jsonl``: the checkpoint
snapshot, and agreeing with the other ranks whether to go on). The handover
(watcher, task end, Airflow scheduling, adoption) runs beside the training
and is shown as ``handover``, off the critical path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from relay.launchers.local.adopt import BOUNDARY_FILE, read_adopted, workload_of
from relay.lineage.resume_time import TASK_FILE, retry_marks
from relay_train.protocol.launch import BOUNDARIES_FILE, RESULT_FILE

RESTART_PARTS = ("final_checkpoint", "exit_and_detect", "wake", "stop_and_record", "scheduling",
                 "launch", "agent_start", "rendezvous", "first_step")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _tries(segment_dir: Path) -> list[Path]:
    return sorted((p for p in segment_dir.glob("try-*") if p.name[4:].isdigit()),
                  key=lambda p: int(p.name[4:]))


def _loop_stall(workload: Path, step: int) -> dict[str, Any] | None:
    path = workload / BOUNDARIES_FILE
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("step") == step:
            return entry
    return None


def _adopted(before: Path, after: Path, step: int) -> dict[str, Any]:
    adopted = read_adopted(after) or {}
    entry = _loop_stall(Path(adopted["workload"]), step) or {}
    seen, task = _read(before / BOUNDARY_FILE) or {}, _read(after / TASK_FILE) or {}
    handover = None
    if seen.get("fired_at") and adopted.get("adopted_at"):
        handover = {"watcher_to_task_end": seen["done_at"] - seen["fired_at"],
                    "scheduling": task.get("task_started_at", seen["done_at"]) - seen["done_at"],
                    "adoption": adopted["adopted_at"] - task.get("task_started_at",
                                                                 seen["done_at"])}
    parts = {"checkpoint_stall": entry.get("checkpoint_stall"), "agree": entry.get("agree"),
             "publish": entry.get("publish", 0.0 if entry else None)}
    return {"kind": "adopt", "parts": parts, "total": entry.get("loop_cost"),
            "handover": handover, "adopted_at_step": adopted.get("at_step")}


def _restarted(before: Path, after: Path) -> dict[str, Any]:
    result = _read(workload_of(before) / RESULT_FILE) or {}
    seen, task = _read(before / BOUNDARY_FILE) or {}, _read(after / TASK_FILE)
    nxt = retry_marks(after)
    if "loop_ended_at" not in result or task is None or nxt is None or "done_at" not in seen:
        return {"kind": "restart", "parts": {}, "total": None}
    nxt.pop("agent_start_kind", None)
    marks = [("final_checkpoint", result["published_at"]),
             ("exit_and_detect", seen.get("fired_at") or seen["woke_at"]),
             ("wake", seen["woke_at"]), ("stop_and_record", seen["done_at"]),
             ("scheduling", nxt["retry_scheduling"]), ("launch", nxt["launch"]),
             ("agent_start", nxt["agent_start"]), ("rendezvous", nxt["rendezvous"]),
             ("first_step", nxt["first_step"])]
    parts, last = {}, result["loop_ended_at"]
    for part, at in marks:
        parts[part] = round(at - last, 3)
        last = at
    return {"kind": "restart", "parts": parts, "total": round(last - result["loop_ended_at"], 3)}


def boundaries(run_dir: Path) -> list[dict[str, Any]]:
    """Return one breakdown per segment boundary of a DAG run (its attempt folders)."""
    segments = sorted(p for p in run_dir.glob("segment-*") if p.is_dir())
    rows = []
    for before_seg, after_seg in zip(segments, segments[1:], strict=False):
        before, after = _tries(before_seg), _tries(after_seg)
        if not before or not after:
            continue
        last, first = before[-1], after[0]
        if read_adopted(first) is not None:
            row = _adopted(last, first, _segment_end(last))
        else:
            row = _restarted(last, first)
        rows.append({"after_segment": int(before_seg.name.split("-")[1]), **row})
    return rows


def _segment_end(attempt: Path) -> int:
    view = read_adopted(attempt)
    if view is not None:
        return int(view["end_step"])
    return int(json.loads((attempt / "launch.json").read_text())["end_step"])


def format_row(row: dict[str, Any]) -> str:
    """Return one boundary as a line: kind, total, parts."""
    total = "?" if row.get("total") is None else f"{row['total']:.2f}s"
    parts = " + ".join(f"{p} {'?' if s is None else f'{s:.2f}s'}"
                       for p, s in row.get("parts", {}).items())
    line = f"after segment {row['after_segment']}: {row['kind']:<7} {total:>7} = {parts}"
    if row.get("handover"):
        beside = ", ".join(f"{k} {v:.1f}s" for k, v in row["handover"].items())
        line += f"  (beside the training: {beside})"
    return line


def main(argv: list[str] | None = None) -> int:
    """``python -m relay.tools.bench.boundary_time RUN_DIR``: print a run's boundary breakdown."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m relay.tools.bench.boundary_time RUN_DIR  "
              "(e.g. .relay/runs/relay_demo/"
              "<run>; expected a folder holding segment-NNN/try-N)", file=sys.stderr)
        return 2
    for row in boundaries(Path(args[0])):
        print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
