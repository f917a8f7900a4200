"""Unit tests for what `relay bench scheduled` prints and how it sets up its home.

No service starts here and nothing is timed; the end-to-end smoke is
tests/services/test_bench_scheduled.py (`make test-services`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay.bench.goodput import Run
from relay.bench.scheduled import _bench_env, figure, goal_verdict, print_run, summarise


def _fault(kind: str, resume: float | None, detected: float | None = 2.0,
           lost: int | None = 0) -> dict:
    return {"kind": kind, "detected_after": detected, "lost_steps": lost,
            "fault_to_resume": resume, "ended_by": "Relay's watcher", "parts": None}


def test_summarise_gathers_each_kind_over_the_repeats_and_skips_missing_figures() -> None:
    runs = [Run("repeat 1/2", True, 180.0, 7, [_fault("hang", 11.0), _fault("straggler", 9.0)]),
            Run("repeat 2/2", True, 190.0, 7, [_fault("hang", None, detected=3.0, lost=None),
                                               _fault("hang", 8.0, lost=2)])]

    found = summarise(runs)

    assert list(found) == ["hang", "straggler"]
    assert found["hang"] == {"detected_after": [2.0, 3.0, 2.0], "lost_steps": [0.0, 2.0],
                             "fault_to_resume": [11.0, 8.0]}
    assert found["straggler"]["fault_to_resume"] == [9.0]


def test_the_goal_is_judged_on_the_median() -> None:
    assert goal_verdict([9.0, 12.0, 9.5]) == "goal <= 9.5s: met"
    assert goal_verdict([9.0, 12.0, 9.6]) == "goal <= 9.5s: NOT met"
    assert goal_verdict([]) == "no figure"


def test_one_figure_is_printed_as_is_several_as_median_and_spread() -> None:
    assert figure([7.34]) == "7.3s"
    assert figure([7.0, 11.0, 8.0]) == "8.0s [7.0s-11.0s]"


def test_a_fault_prints_its_parts_and_their_sum(capsys: pytest.CaptureFixture[str]) -> None:
    fault = {**_fault("node_unresponsive", 3.5),
             "parts": {"detect": 2.0, "wake": 1.0, "first_step": 0.5, "rescue": None}}

    print_run(Run("repeat 1/1", True, 100.0, 5, [fault], note="run manual__x"))

    out = capsys.readouterr().out
    assert "node_unresponsive" in out and "fault -> first productive step 3.50s" in out
    assert "detect 2.00s, wake 1.00s, first_step 0.50s, rescue - (sum 3.50s)" in out


def test_the_bench_home_is_set_up_and_the_environment_restored(tmp_path: Path) -> None:
    before = {k: os.environ.get(k) for k in ("RELAY_HOME", "RELAY_JOBS_DIR", "RELAY_NODES",
                                             "RELAY_MLFLOW_TRACKING_URI")}

    with _bench_env(tmp_path / "home") as jobs:
        assert jobs == tmp_path / "home" / "jobs" and jobs.is_dir()
        assert os.environ["RELAY_HOME"] == str(tmp_path / "home")
        assert os.environ["RELAY_NODES"].split(",")[0] == "node-a"
        assert "RELAY_MLFLOW_TRACKING_URI" not in os.environ

    assert {k: os.environ.get(k) for k in before} == before


def test_the_cli_wires_the_benchmark_with_one_repeat_by_default() -> None:
    from relay.cli import _cmd_bench_scheduled, build_parser

    args = build_parser().parse_args(["bench", "scheduled", "--smoke"])

    assert args.func is _cmd_bench_scheduled
    assert (args.steps, args.segment, args.every, args.repeats, args.smoke) == (
        1200, 300, 25, 1, True)
