"""Unit tests for the start-up breakdown `relay bench goodput` prints (no run, no timing)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from relay.lineage.resume_time import PREFLIGHT_FILE, TASK_FILE
from relay.tools.bench.goodput import Run, startup_text
from relay.tools.bench.startup_time import PARTS, format_parts, startup_parts
from relay_train.protocol.launch import FIRST_STEP_FILE

T0 = 1_800_000_000.0


def _line(at: float, text: str) -> str:
    stamp = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")
    return f"{stamp}Z [info     ] {text}"


def _run(tmp_path: Path, first_step: bool = True) -> tuple[Path, Path]:
    run_dir = tmp_path / "runs" / "relay_goodput" / "manual_1"
    attempt = run_dir / "segment-000" / "try-1"
    attempt.mkdir(parents=True)
    (run_dir / PREFLIGHT_FILE).write_text(json.dumps({"started_at": T0 + 6, "ended_at": T0 + 7}))
    (attempt / TASK_FILE).write_text(json.dumps({"task_started_at": T0 + 7.5,
                                                 "launch_called_at": T0 + 7.75}))
    if first_step:
        (attempt / FIRST_STEP_FILE).write_text(json.dumps(
            {"at": T0 + 9, "spawned_at": T0 + 8, "startup": {"imports": 0.25,
                                                              "rendezvous": 0.25}}))
    log_file = tmp_path / "run.log"
    log_file.write_text("\n".join([
        "not a log line", _line(T0 + 2, "Could not import graphviz"),
        _line(T0 + 4, "creating dag run"), _line(T0 + 4.5, "[DAG TEST] starting task_id=preflight"),
        _line(T0 + 30, "[DAG TEST] starting task_id=finalize")]))
    return log_file, run_dir


def test_the_parts_are_consecutive_marks_and_add_up_to_the_first_step(tmp_path: Path) -> None:
    log_file, run_dir = _run(tmp_path)

    parts = startup_parts(T0, log_file, run_dir)

    assert list(parts) == list(PARTS)
    assert parts == pytest.approx({
        "airflow_cli": 2.0, "dag_parse_and_sync": 2.0, "dag_run_created": 0.5,
        "task_runner": 1.5, "preflight": 1.0, "segment_task": 0.5, "launch": 0.25,
        "agent_start": 0.25, "rendezvous": 0.5, "first_step": 0.5})
    assert format_parts(parts).startswith("9.00s = airflow_cli 2.00s + ")


def test_an_attempt_that_never_stepped_leaves_the_segments_parts_unknown(
        tmp_path: Path) -> None:
    log_file, run_dir = _run(tmp_path, first_step=False)

    parts = startup_parts(T0, log_file, run_dir)

    assert parts["preflight"] == pytest.approx(1.0)
    assert [parts[p] for p in PARTS[5:]] == [None] * 5
    assert format_parts(parts).startswith("incomplete = ")


def test_goodput_reads_the_log_its_runner_wrote_for_the_run(tmp_path: Path) -> None:
    log_file, run_dir = _run(tmp_path)
    (tmp_path / "logs").mkdir()
    log_file.rename(tmp_path / "logs" / "relay-fault-free.log")

    text = startup_text(Run("relay fault-free", True, 40.0, 1, started=T0), run_dir)

    assert text.startswith("9.00s = airflow_cli 2.00s + dag_parse_and_sync 2.00s + ")
