"""Unit tests for what `relay bench resume` injects and how it sums up (no run, no timing)."""

from __future__ import annotations

import pytest

from relay.tools.bench.goodput import Run
from relay.tools.bench.resume import per_kind, print_summary, run_line, schedule
from relay_train.protocol.injection import InjectedFault


def _fault(kind: str, resume: float | None, detected: float | None = 2.0) -> dict:
    return {"kind": kind, "lost_steps": 0, "detected_after": detected,
            "fault_to_resume": resume, "ended_by": "Relay's watcher",
            "parts": {"detect": detected, "first_step": 0.2}}


def test_the_schedule_is_goodputs_stalled_rank_and_frozen_node_only() -> None:
    faults = [InjectedFault.from_dict(raw) for raw in schedule(240)]

    assert [f.kind for f in faults] == ["hang", "stop_node"]
    assert [f.rank for f in faults] == [1, 2]
    assert all(0 < f.step < 240 for f in faults)


def test_a_false_alarm_of_the_same_kind_has_no_figure() -> None:
    runs = [Run("run 1", True, 30.0, 3, [_fault("hang", 3.0), _fault("node_unresponsive", 2.9)]),
            Run("run 2", True, 31.0, 4, [_fault("hang", 3.2), _fault("hang", 1.0, None),
                                         _fault("node_unresponsive", None)])]

    assert per_kind(runs) == {"hang": [3.0, 3.2], "node_unresponsive": [2.9]}


def test_the_summary_says_the_median_misses_the_goal(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [Run(f"run {i}", True, 30.0, 3, [_fault("hang", s), _fault("node_unresponsive", 1.9)])
            for i, s in enumerate((3.01, 1.5, 2.6), start=1)]

    print_summary(runs)

    out = capsys.readouterr().out
    assert "hang               3.1s / 1.5s / 2.6s: median 2.60s; goal <= 2s NOT met by the " \
           "median, in 1 of 3 repeat(s)" in out
    assert "node_unresponsive  1.9s / 1.9s / 1.9s: median 1.90s; goal <= 2s met" in out
    assert "first_step" in out  # the parts' medians


def test_a_run_line_names_each_fault_and_a_run_without_one() -> None:
    assert run_line(2, Run("run 2", False, 12.5, 1)) == \
        "  run 2: FAILED, 12.5s, 1 tries; no recovery recorded"
    assert "hang 3.0s (detected after 2.0s, lost 0)" in run_line(1, Run(
        "run 1", True, 30.0, 2, [_fault("hang", 3.0)]))
