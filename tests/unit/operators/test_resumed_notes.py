"""A retry that reaches its segment's end rewrites Relay's notes with the time to resume,
whether it completes or hands its workload over to the next segment (a regression: the
handover path left the DAG run's note at "not resumed yet" on a run that had resumed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from relay.operators import handover, segment_end
from relay.operators.segment import TrainSegmentOperator

PARENT = "parent-run"


def _op(monkeypatch: pytest.MonkeyPatch, calls: list[Any]) -> TrainSegmentOperator:
    op = TrainSegmentOperator(task_id="segment_000", segment=0, spec_file="unused.yaml")
    monkeypatch.setattr(TrainSegmentOperator, "finish_resume_time",
                        staticmethod(lambda attempt, lineage, launcher: calls.append("timed")))
    monkeypatch.setattr(segment_end, "write_notes", lambda context, lineage, parent, index:
                        calls.append(("notes", parent(), index)))
    return op


@pytest.mark.parametrize(("try_number", "notes"), [(1, False), (2, True)])
def test_an_attempt_at_its_end_finishes_its_time_to_resume_and_a_retry_rewrites_the_notes(
        monkeypatch: pytest.MonkeyPatch, try_number: int, notes: bool) -> None:
    calls: list[Any] = []
    op = _op(monkeypatch, calls)
    context = {"ti": SimpleNamespace(try_number=try_number)}
    op.resumed(context, SimpleNamespace(), None, SimpleNamespace(), lambda: PARENT)
    assert calls == ["timed", *([("notes", PARENT, 0)] if notes else [])]


def test_a_retry_that_hands_over_rewrites_the_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    op = _op(monkeypatch, calls)
    monkeypatch.setattr(TrainSegmentOperator, "policy", lambda self, spec: SimpleNamespace(
        policy=SimpleNamespace(detection=SimpleNamespace(checkpoint_timeout=1.0))))
    monkeypatch.setattr(TrainSegmentOperator, "spec", lambda self: None)
    monkeypatch.setattr(TrainSegmentOperator, "log_observations", lambda *a: None)
    continuity = SimpleNamespace(wait_published=lambda *a: True, note_boundary=lambda *a: None)
    lineage = SimpleNamespace(finish_run=lambda *a: None)
    cfg = SimpleNamespace(run_id="try-2", start_step=35, end_step=60)
    context = {"ti": SimpleNamespace(try_number=2)}
    assert handover.handed_over(op, context, {"boundary_step": 60}, SimpleNamespace(runs_in="w"),
                                cfg, lineage, SimpleNamespace(continuity=continuity), 0.0,
                                PARENT)  # type: ignore[arg-type]
    assert calls == ["timed", ("notes", PARENT, 0)]
