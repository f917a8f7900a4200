"""Every job spec becomes a DAG through Airflow's own DagBag; a bad spec is an import error."""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag

from relay.core import settings

DAGS = settings.REPO_ROOT / "dags"

GOOD = """\
job: good
total_steps: 40
steps_per_segment: 20
checkpoint_every: 10
"""

BAD = """\
job: broken
total_steps: 40
steps_per_segment: -5
checkpoint_every: 10
"""


def test_repository_dags_load_without_import_errors() -> None:
    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    dag = bag.dags["relay_demo"]
    assert dag.task_ids == [
        "preflight", "segment_000", "segment_001", "segment_002", "segment_003", "finalize"
    ]
    # The chain is linear: each segment waits for the previous one.
    assert dag.get_task("segment_001").upstream_task_ids == {"segment_000"}
    assert dag.get_task("finalize").upstream_task_ids == {"segment_003"}


def test_bad_spec_is_an_import_error_and_good_jobs_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "broken.yaml").write_text(BAD)
    monkeypatch.setenv("RELAY_JOBS_DIR", str(tmp_path))
    bag = DagBag(dag_folder=str(DAGS))
    assert "relay_good" in bag.dags
    assert "relay_broken" not in bag.dags
    assert len(bag.import_errors) == 1
    (where, message), = bag.import_errors.items()
    assert where.endswith("relay_spec_errors.py")
    assert "broken.yaml:3" in message
    assert "steps_per_segment" in message
    assert "Fix:" in message
