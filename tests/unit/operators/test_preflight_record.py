"""Preflight records when it started, even when no standby made the run's folder."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from relay.lineage.resume_time import PREFLIGHT_FILE, preflight_started_at
from relay.operators import base as operators


class _Lineage:
    def parent_run(self, *_args: Any) -> str:  # noqa: ANN401
        return "parent-1"


def test_preflight_records_its_start_in_a_run_folder_nothing_made_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    spec = tmp_path / "job.yaml"
    spec.write_text("job: rec\nseed: 1\ntotal_steps: 20\nsteps_per_segment: 10\n"
                    "checkpoint_every: 5\nnodes: 1\nranks_per_node: 1\n")
    monkeypatch.setattr(operators, "lineage_store", _Lineage)
    # As when the pool has too few nodes: no standby, so nothing made the run's folder.
    monkeypatch.setattr(operators.PreflightOperator, "_warm_first_segment",
                        staticmethod(lambda *_: None))
    op = operators.PreflightOperator(task_id="preflight", spec_file=str(spec))
    context = {"dag_run": SimpleNamespace(conf={}, run_id="manual__1")}
    assert op.execute(context) == "parent-1"
    run_dir = operators.segment_dir(op.spec(), "manual__1", 0).parent
    record = json.loads((run_dir / PREFLIGHT_FILE).read_text())
    assert record["mlflow_run"] == "parent-1"
    assert record["started_at"] <= record["ended_at"]
    assert preflight_started_at(run_dir) == record["started_at"]
    assert preflight_started_at(tmp_path) is None  # a run preflight never finished
