"""Unit tests for how `relay bench goodput` compares: the schedule, the rows, the derivation.

No benchmark runs here and nothing is timed; the smoke runs are `relay bench
goodput --smoke` and friends.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from relay.lineage.resume_time import PREFLIGHT_FILE
from relay.tools.bench.goodput import (
    GLOO_DEFAULT_TIMEOUT_SECONDS,
    Run,
    derive_default_timeout,
    ends,
    fault_schedule,
    relay_faults,
)
from relay.tools.bench.goodput_report import ettr, spread
from relay.tools.bench.torchrun_baseline import _cause
from relay_train.protocol.injection import InjectedFault


def test_the_schedule_is_valid_chaos_and_strikes_rank_positions_once() -> None:
    schedule = fault_schedule(1200)

    faults = [InjectedFault.from_dict(raw) for raw in schedule]
    assert [f.kind for f in faults] == ["hang", "stop_node", "straggler"]
    assert [f.rank for f in faults] == [1, 2, 3]
    assert all(f.once and f.attempt is None and f.node is None for f in faults)
    assert [f.step for f in faults] == sorted(f.step for f in faults)


def test_the_default_timeout_is_derived_only_for_faults_the_timeout_ended() -> None:
    measured = Run("torchrun, timeout 120s", True, 500.0, 3, [
        {"kind": "hang", "ended_by": "collective timeout", "detected_after": 121.0,
         "fault_to_resume": 130.0, "lost_steps": 3},
        {"kind": "crash", "ended_by": "connection reset", "detected_after": 0.1,
         "fault_to_resume": 9.0, "lost_steps": 5},
    ])

    derived = derive_default_timeout(measured, 120.0)

    extra = GLOO_DEFAULT_TIMEOUT_SECONDS - 120.0
    assert derived.wall == pytest.approx(500.0 + extra)
    assert derived.faults[0]["fault_to_resume"] == pytest.approx(130.0 + extra)
    assert derived.faults[0]["detected_after"] == pytest.approx(121.0 + extra)
    assert derived.faults[1] == measured.faults[1]
    assert derived.note.startswith("DERIVED")
    assert measured.faults[0]["fault_to_resume"] == 130.0  # the measured row is untouched


def _attempt(root: Path, name: str, strikes: list[dict], decision: dict | None) -> Path:
    attempt = root / "segment-000" / name
    attempt.mkdir(parents=True)
    (attempt / "chaos.jsonl").write_text("".join(json.dumps(s) + "\n" for s in strikes))
    if decision is not None:
        (attempt / "decision.json").write_text(json.dumps(decision))
    return attempt


def test_relay_rows_come_from_decisions_not_from_strikes(tmp_path: Path) -> None:
    breakdown = {"complete": True, "total": 7.5, "parts": {"detect": 3.0, "wake": 4.5}}
    faulty = _attempt(tmp_path, "try-1", [{"kind": "hang", "at": 100.0}], {
        "fault": {"kind": "hang", "detected_at": 103.0}, "lost_steps": 0,
        "time_to_resume": breakdown})
    # A strike nobody detected (the segment ended first) is no recovery: no row.
    quiet = _attempt(tmp_path, "try-2", [{"kind": "straggler", "at": 110.0}], None)

    rows = relay_faults([faulty, quiet])

    assert rows == [{"kind": "hang", "lost_steps": 0, "detected_after": 3.0,
                     "fault_to_resume": 7.5, "ended_by": "Relay's watcher",
                     "parts": breakdown["parts"]}]


def test_the_baseline_blames_the_one_shot_strike_not_a_slow_node(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path, "try-1", [
        {"kind": "straggler", "at": 5.0}, {"kind": "stop_node", "at": 9.0}], None)

    assert _cause(attempt) == ("stop_node", 9.0)
    assert _cause(tmp_path) == ("unknown", None)


def test_ettr_is_absolute_and_zero_for_an_unfinished_run() -> None:
    assert ettr(Run("r", True, 200.0, 4), 150.0) == pytest.approx(0.75)
    assert ettr(Run("r", False, 200.0, 4), 150.0) == 0.0


def test_spread_prints_median_and_range() -> None:
    assert spread([3.0, 1.0, 2.0]) == "2.0s [1.0s-3.0s]"
    assert spread([]) == "-"


def test_ends_says_what_went_before_the_first_step_and_after_the_last(tmp_path: Path) -> None:
    first, last = tmp_path / "segment-000" / "try-1", tmp_path / "segment-001" / "try-1"
    for folder in (first, last):
        folder.mkdir(parents=True)
    (first / "first_step.json").write_text(json.dumps({"step": 1, "at": 1012.5}))
    (first / "result.json").write_text(json.dumps({"loop_ended_at": 1050.0}))
    (last / "result.json").write_text(json.dumps({"loop_ended_at": 1100.0}))
    run = Run("relay fault-free", True, wall=104.0, attempts=2, started=1000.0)
    assert ends(run, [first, last]) == (
        "start-up 12.5s (run start -> first step done), wind-down 4.0s (last step -> run end)")
    assert "unknown" in ends(run, [last])  # no first step recorded
    (tmp_path / PREFLIGHT_FILE).write_text(json.dumps({"started_at": 1009.0}))  # Relay's run
    assert ends(run, [first, last]).startswith(
        "start-up 12.5s (run start -> first step done: Airflow 9.0s until Relay's preflight "
        "started, Relay 3.5s from there), ")


def test_keep_refuses_a_folder_with_files_and_names_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from relay.tools.cli import main as cli

    (tmp_path / "earlier.txt").write_text("a reader's notes")
    assert cli(["bench", "goodput", "--keep", str(tmp_path)]) == 2
    assert "expected a new or empty folder" in capsys.readouterr().err
    assert (tmp_path / "earlier.txt").read_text() == "a reader's notes"  # nothing touched


def test_a_baseline_run_never_resumes_another_runs_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeats sharing one MLflow store once found the first repeat's finished run, resumed
    at its last step and "trained" a whole job in seconds: the baseline refuses instead,
    before it starts any torchrun (real MLflow store on disk, one checkpoint published)."""
    from published import publish_checkpoint as _publish

    from relay.lineage.store import Lineage
    from relay.tools.bench import torchrun_baseline
    from relay.tools.bench.goodput import NODE_POOL, _job
    from relay.tools.bench.torchrun_baseline import run_baseline

    def start(*_: object) -> None:
        raise AssertionError("the baseline started torchrun on another run's checkpoints")

    monkeypatch.setattr(torchrun_baseline, "_start", start)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lineage = Lineage(uri, tmp_path / "artifacts")
    parent = lineage.parent_run("goodput-baseline", "baseline", "repeat-1/fault-free")
    _publish(lineage, lineage.attempt_run(parent, 0, 1, {}), 40, tmp_path / "published")

    with pytest.raises(RuntimeError, match="expected a new MLflow run.*step 40"):
        run_baseline(tmp_path / "repeat-1" / "fault-free", _job(40, 20), [], NODE_POOL, 60.0,
                     uri)


def test_an_interrupted_baseline_leaves_no_torchrun_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM or Ctrl-C in the benchmark while the baseline trains: the torchruns and
    their children (each in a session of its own) are killed, and the interruption goes on."""
    import subprocess
    import sys

    from relay.tools.bench import torchrun_baseline

    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)'], start_new_session=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not torchrun_baseline._descendants(proc.pid):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    child = torchrun_baseline._descendants(proc.pid)[0]

    def interrupted(_seconds: float) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(torchrun_baseline.time, "sleep", interrupted)
    with pytest.raises(SystemExit):
        torchrun_baseline._supervise({"node-a": proc})
    assert proc.poll() is not None
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and _state(child) != "Z":
        assert time.monotonic() < deadline, f"pid {child} outlived the baseline"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _repeat(free_wall: float, faulty_wall: float, lost: int = 0,
            faulty_ok: bool = True) -> list[Run]:
    faults = [{"kind": k, "lost_steps": lost, "fault_to_resume": 3.0 + i}
              for i, k in enumerate(("hang", "node_unresponsive", "straggler"))]
    return [Run("relay fault-free", True, free_wall, 4),
            Run("relay with faults", faulty_ok, faulty_wall, 7, faults),
            Run("torchrun fault-free", True, 90.0, 1)]


def test_relative_ettr_is_each_repeats_fault_free_wall_over_its_faulty_wall() -> None:
    from relay.tools.bench.goodput_report import relative_ettrs

    runs = [_repeat(100.0, 110.0), _repeat(100.0, 125.0), _repeat(100.0, 120.0, faulty_ok=False)]
    assert relative_ettrs(runs) == pytest.approx([100 / 110, 0.8, 0.0])


def test_the_goals_say_met_or_not_by_the_median_and_per_repeat(
        capsys: pytest.CaptureFixture[str]) -> None:
    from relay.tools.bench.goodput_report import print_goals

    print_goals([_repeat(100.0, 110.0), _repeat(100.0, 115.0), _repeat(100.0, 108.0)],
                [92.0, 92.0, 92.0])
    out = capsys.readouterr().out
    assert "relative to fault-free >= 0.9 (fault-free wall / faulty wall, same repeat): " \
        "0.909 / 0.869 / 0.925: met by the median, in 2 of 3 repeat(s)" in out
    assert "absolute ETTR fault-free >= 0.9: 0.920 / 0.920 / 0.920: met by the median, in 3 of 3" \
        in out
    assert "straggler          5.0s / 5.0s / 5.0s: met by the median, in 3 of 3" in out
    assert "lost steps 0 for a stalled rank, a frozen node and a straggler: met" in out

    print_goals([_repeat(100.0, 130.0, lost=3)], [85.0])
    out = capsys.readouterr().out
    assert "0.769: NOT met by the median, in 0 of 1 repeat(s)" in out
    assert "absolute ETTR fault-free >= 0.9: 0.850: NOT met" in out
    assert "straggler: NOT met (hang 3; node_unresponsive 3; straggler 3)" in out


def test_a_figure_printed_beside_a_goal_never_rounds_across_it() -> None:
    from relay.tools.bench.goodput_report import toward_goal

    assert toward_goal(0.8996, 3, at_least=True) == "0.899"  # rounding said 0.900
    assert toward_goal(0.92, 3, at_least=True) == "0.920"
    assert toward_goal(7.04, 1, at_least=False) == "7.1"  # rounding said 7.0 (<= 7 s)
    assert toward_goal(5.0, 1, at_least=False) == "5.0"
