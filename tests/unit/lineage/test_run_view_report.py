"""Goodput, progress, the report's pictures and lineage.json, against a real MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

from relay.lineage.report import FaultRow
from relay.lineage.report_files import (
    plot_timeline,
    render,
    steps_per_second,
    summary_text,
    throughput_series,
)
from relay.lineage.run_view import AttemptView, RunView, _progress, find_parent, goodput, run_view
from relay.lineage.store import TAG_EXPERIMENT_KIND, Lineage
from relay.lineage.summary import lineage_record
from relay.lineage.tags import TAG_ADOPTED_AT, TAG_HANDED_OVER_AT
from relay_train.protocol.manifest import CheckpointManifest, CheckpointRef

T0 = 1_000.0
HANG = {"kind": "hang", "culprit_rank": 1, "culprit_node": "node-a",
        "evidence": {"summary": "rank 1 stalled"}, "detected_at": T0 + 40}


def _attempts() -> list[AttemptView]:
    # Segment 0: starts at 0 s, first step at 10 s, hangs at 36 s (detected 4 s later at 40 s),
    # stopped at 45 s; the retry on node-b/node-c trains from 50 s to 70 s.
    return [
        AttemptView(0, 1, "r1", ["node-a", "node-b"], 0, 60, "faulted", T0, T0 + 45, T0 + 10, 35,
                    HANG, {"action": "restart_elsewhere", "rule": "rules.hang"}, 5, 30),
        AttemptView(0, 2, "r2", ["node-b", "node-c"], 30, 60, "completed", T0 + 46, T0 + 70,
                    T0 + 50, 60),
    ]


def _faults() -> list[FaultRow]:
    return [FaultRow(0, "hang", "rank 1, node-a", 4.0, "restart_elsewhere", 5, 10.0)]


def test_goodput_counts_time_from_the_strike_to_the_retrys_first_step_as_lost() -> None:
    g = goodput(_attempts(), _faults(), T0, T0 + 80, now=T0 + 80)
    # Faulty attempt: productive 10 s -> 36 s (26 s, 35 steps), 5 of them lost -> 26*5/35 s.
    wasted = 26 * 5 / 35
    assert abs(g["lost_seconds_by_fault"]["hang"] - (wasted + 50 - 36)) < 1e-3
    assert abs(g["productive_seconds"] - (26 - wasted + 20)) < 1e-3
    assert abs(g["ettr"] - (26 - wasted + 20) / 80) < 1e-3


def test_progress_and_eta_follow_the_completed_attempts_pace() -> None:
    attempts = _attempts()
    step, eta = _progress(attempts, total=120, now=T0 + 75, finished=False)
    assert step == 60
    # The retry trained 30 steps in 20 s: 60 steps left at 2/3 s each.
    assert eta == 40.0
    assert _progress(attempts, total=60, now=T0 + 75, finished=True) == (60, 0.0)


def _view(attempts: list[AttemptView]) -> RunView:
    return RunView("demo", "relay_demo", "manual__1", "p", "running", 120, "ab" * 32, T0, None,
                   attempts, _faults(), 60, goodput(attempts, _faults(), T0, None, T0 + 80),
                   40.0)


def test_timeline_png_and_summary(tmp_path: Path) -> None:
    view = _view(_attempts())
    path = plot_timeline(view, tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = summary_text(view)
    assert "hang" in text and "rank 1, node-a" in text and "ETA 40s" in text


def test_steps_per_second_is_the_inverse_step_time_against_the_runs_time() -> None:
    points = [(T0 + 12, 0.5), (T0 + 11, 0.25), (T0 + 13, float("nan")), (T0 + 14, -1.0)]
    assert steps_per_second(points, T0) == [(11.0, 4.0), (12.0, 2.0)]
    assert steps_per_second([], T0) == []


def _lineage(tmp_path: Path) -> Lineage:
    return Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")


def test_experiments_open_in_the_model_training_view(tmp_path: Path) -> None:
    lineage = _lineage(tmp_path)
    exp = lineage.client.get_experiment(lineage.experiment_id("demo"))
    assert exp.tags[TAG_EXPERIMENT_KIND] == "custom_model_development"


def test_lineage_json_has_machine_readable_fields_and_the_report_reads_the_store(
        tmp_path: Path) -> None:
    lineage = _lineage(tmp_path)
    parent = lineage.parent_run("demo", "relay_demo", "manual__1", {"total_steps": 40})
    first = lineage.attempt_run(parent, 0, 1, {"nodes": "node-a", "resume_step": 0,
                                               "end_step": 20})
    lineage.client.log_metric(first, "loss", 3.5, step=10)
    for step, seconds, at in ((9, 0.5, T0 + 10), (10, 0.25, T0 + 11), (11, 0.0, T0 + 12)):
        lineage.client.log_metric(first, "step_seconds", seconds, step=step,
                                  timestamp=int(at * 1000))
    lineage.client.set_tag(first, TAG_HANDED_OVER_AT, "20")
    second = lineage.attempt_run(parent, 1, 2, {"nodes": "node-b", "resume_step": 20,
                                                "end_step": 40})
    lineage.client.set_tag(second, TAG_ADOPTED_AT, "not a step")  # anyone's to write
    older = CheckpointManifest(20, "a" * 64, 10, 4, "demo", first, None, T0)
    newer = CheckpointManifest(40, "b" * 64, 10, 4, "demo", second,
                               CheckpointRef(first, 20, "a" * 64), T0 + 1,
                               origin="rescued from rank 0 after hang")
    record = lineage_record(lineage, parent, [newer, older])
    json.dumps(record)  # JSON as is
    top = record["chain"][0]
    assert top == {"step": 40, "sha256": "b" * 64, "run_id": second,
                   "parent": {"run_id": first, "step": 20, "sha256": "a" * 64},
                   "origin": "rescued from rank 0 after hang", "segment": 1, "attempt": 2,
                   "size_bytes": 10, "world_size": 4, "created_at": T0 + 1}
    assert record["chain"][1]["parent"] is None and record["chain"][1]["segment"] == 0
    assert record["final"] == {"run_id": second, "step": 40, "sha256": "b" * 64}

    assert find_parent(lineage, "demo", None) == parent
    view = run_view(lineage, parent)
    assert [(a.segment, a.try_number, a.nodes) for a in view.attempts] == [
        (0, 1, ["node-a"]), (1, 2, ["node-b"])]
    assert [(a.handed_over_at, a.adopted_at) for a in view.attempts] == [(20, None), (None, None)]
    # Throughput: rank 0's step times as steps/s over the run's time; a zero is left out.
    started = view.started_at
    assert throughput_series(view, lineage) == {
        first: [(T0 + 10 - started, 2.0), (T0 + 11 - started, 4.0)]}
    written = render(view, lineage, tmp_path / "out")
    assert sorted(p.name for p in written) == ["faults.txt", "loss.png", "report.json",
                                               "throughput.png", "timeline.png"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["parent_run_id"] == parent
