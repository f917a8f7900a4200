"""The Recovery index: per DAG run its faults, lost steps, time lost, ETTR and outcome; runs
with faults stand out; an ended run's figures are read from MLflow once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from relay.lineage import run_view
from relay.lineage.run_view import RunSummary
from relay.ui import recovery_page
from relay.ui.page_html import index_html


def _run(run_id: str, dag_run: str, end_time: int | None = 1_800_000_100_000) -> Any:  # noqa: ANN401
    return SimpleNamespace(
        info=SimpleNamespace(run_id=run_id, start_time=1_800_000_000_000, end_time=end_time,
                             status="FINISHED" if end_time else "RUNNING"),
        data=SimpleNamespace(tags={"relay.dag_run_id": dag_run, "relay.outcome": "completed"}))


def _rows(html: str) -> list[str]:
    return [row for row in html.split("<tr") if "href=" in row]


def test_runs_with_faults_stand_out_with_their_figures() -> None:
    faulty, clean, unreadable = (_run("a1", "manual__faulty"), _run("b2", "manual__clean"),
                                 _run("c3", "manual__<b>x</b>"))
    summaries = {"a1": RunSummary("completed", 2, 3, 12.34, 0.87),
                 "b2": RunSummary("completed", 0, 0, 0.0, 0.93), "c3": None}

    html = index_html({"e2e": [faulty, clean, unreadable]}, summaries, "n0nce")

    first, second, third = _rows(html)
    assert "class='faulted'" in first and "<span class='badge'>2 faults</span>" in first
    assert "<td>3</td><td>12.3s</td><td>0.87</td>" in first
    assert "faulted" not in second and "<td>0</td><td>0</td><td>0.0s</td><td>0.93</td>" in second
    assert "not readable" in third and "&lt;b&gt;x&lt;/b&gt;" in third  # escaped, never markup


def test_an_ended_runs_figures_are_read_once_a_running_runs_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(recovery_page, "pictures_dir", lambda run_id: tmp_path / run_id)
    reads: list[str] = []

    def read(lineage: object, run_id: str) -> Any:  # noqa: ANN401
        reads.append(run_id)
        return SimpleNamespace(summary=lambda: RunSummary("completed", 1, 0, 5.0, 0.9))

    monkeypatch.setattr(run_view, "run_view", read)
    ended, running = _run("ended1", "manual__1"), _run("running1", "manual__2", end_time=None)

    for _ in range(2):
        assert recovery_page._summary(None, ended) == RunSummary("completed", 1, 0, 5.0, 0.9)
        assert recovery_page._summary(None, running) is not None
    assert reads == ["ended1", "running1", "running1"]

    ran_again = _run("ended1", "manual__1", end_time=1_800_000_900_000)  # cleared, re-run
    recovery_page._summary(None, ran_again)
    assert reads[-1] == "ended1"
