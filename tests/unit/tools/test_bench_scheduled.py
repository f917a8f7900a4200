"""Unit tests for what `relay bench scheduled` prints and how it sets up its home.

No service starts here and nothing is timed; the end-to-end smoke is
tests/services/test_bench_scheduled.py (`make test-services`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay.tools.bench.goodput import Run
from relay.tools.bench.scheduled import (
    _bench_env,
    dag_run_ended_at,
    figure,
    goal_verdict,
    print_run,
    print_summary,
    summarise,
)


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
    assert goal_verdict([9.0, 12.0, 9.5]) == "goal <= 9.5s: met by the median, in 2 of 3 repeat(s)"
    assert goal_verdict([9.0, 12.0, 9.6]) == (
        "goal <= 9.5s: NOT met by the median, in 1 of 3 repeat(s)")
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
    from relay.tools.cli import build_parser
    from relay.tools.cli_bench import _cmd_bench_scheduled

    args = build_parser().parse_args(["bench", "scheduled", "--smoke"])

    assert args.func is _cmd_bench_scheduled
    assert (args.steps, args.segment, args.every, args.repeats, args.smoke) == (
        1200, 300, 25, 1, True)
    assert args.no_ettr is False
    assert build_parser().parse_args(["bench", "scheduled", "--no-ettr"]).no_ettr is True


class _Api:
    """Stands in for the REST API's answer about one DAG run (no service runs here)."""

    def __init__(self, run: dict) -> None:
        self.run = run

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.run


def test_a_runs_end_is_the_end_airflow_recorded() -> None:
    ended = dag_run_ended_at(_Api({"end_date": "2026-12-04T15:16:16.500000Z"}), "r")

    assert ended == pytest.approx(1796397376.5)
    assert dag_run_ended_at(_Api({"end_date": None}), "r") is None


def test_the_summary_gives_every_runs_ettr_and_judges_the_goal_on_the_median(
        capsys: pytest.CaptureFixture[str]) -> None:
    def repeat(free_wall: float) -> list[Run]:
        return [Run("relay with faults", True, 160.0, 7, [_fault("hang", 5.0)]),
                Run("relay fault-free", True, free_wall, 4),
                Run("torchrun fault-free", True, 130.0, 1)]

    print_summary([repeat(135.0), repeat(150.0), repeat(140.0)], [126.0, 126.0, 126.0])

    out = capsys.readouterr().out
    assert "relay fault-free" in out and "0.90 [0.84-0.93]" in out  # 126/140, 126/150, 126/135
    assert "torchrun fault-free" in out and "0.97 [0.97-0.97]" in out
    assert ("absolute ETTR >= 0.9 fault-free: 0.933 / 0.840 / 0.900: met by the median, "
            "in 2 of 3 repeat(s)") in out
    print_summary([repeat(150.0)], [126.0])
    assert "fault-free: 0.840: NOT met by the median, in 0 of 1 repeat(s)" in (
        capsys.readouterr().out)


def test_without_ettr_the_summary_has_no_ettr(capsys: pytest.CaptureFixture[str]) -> None:
    print_summary([[Run("relay with faults", True, 160.0, 7, [_fault("hang", 5.0)])]], [])

    out = capsys.readouterr().out
    assert "hang" in out and "ETTR" not in out
