"""Fault injection is off unless the job's spec opts in; a refused conf opens no MLflow run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from relay.core.exceptions import ChaosConfError, ConfigError
from relay.core.settings import REPO_ROOT
from relay.operators import base as operators
from relay.spec.chaos_conf import CHAOS_EXAMPLE, chaos_faults
from relay.spec.job import JobSpec, load_job_spec

DEMO = REPO_ROOT / "dags" / "jobs" / "demo.yaml"
CRASH = {"kind": "crash", "segment": 1, "step": 75, "rank": 1, "attempt": 1}


def spec_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text("job: prod\ntotal_steps: 40\nsteps_per_segment: 20\ncheckpoint_every: 10\n"
                    + extra)
    return path


def test_chaos_is_forbidden_by_default_and_the_demo_allows_it(tmp_path: Path) -> None:
    assert not load_job_spec(spec_file(tmp_path)).chaos_allowed
    assert load_job_spec(DEMO).chaos_allowed


def test_a_bad_chaos_setting_is_a_spec_error_at_its_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_job_spec(spec_file(tmp_path, "chaos: yes please\n"))
    assert f"{tmp_path / 'job.yaml'}:5: chaos" in str(err.value)
    assert "chaos: allowed" in str(err.value)


def test_a_job_without_opt_in_refuses_chaos_and_says_how_to_allow_it(tmp_path: Path) -> None:
    path = spec_file(tmp_path)
    spec = load_job_spec(path)
    assert chaos_faults({}, spec, path) == []
    assert chaos_faults({"chaos": []}, spec, path) == []
    with pytest.raises(ChaosConfError) as err:
        chaos_faults({"chaos": [CRASH]}, spec, path)
    assert "does not allow fault injection" in str(err.value)
    assert f"`chaos: allowed` to {path}" in str(err.value)


def test_entries_typed_as_json_text_become_objects_and_bad_ones_are_refused() -> None:
    spec = load_job_spec(DEMO)
    assert chaos_faults({"chaos": [CHAOS_EXAMPLE[1:-1]]}, spec, DEMO) == [CRASH]
    assert chaos_faults({"chaos": CHAOS_EXAMPLE}, spec, DEMO) == [CRASH]
    with pytest.raises(ChaosConfError, match=r"`chaos`\[0\]: expected a JSON object"):
        chaos_faults({"chaos": ["crash at 75"]}, spec, DEMO)
    with pytest.raises(ChaosConfError, match="chaos fault kind"):
        chaos_faults({"chaos": [{"kind": "meteor", "step": 1}]}, spec, DEMO)


def test_the_chaos_param_takes_the_documented_example_as_objects_and_refuses_strings() -> None:
    from relay.operators.dag_factory import build_dag

    param = build_dag(load_job_spec(DEMO), DEMO).params.get_param("chaos")
    assert param.schema["items"]["type"] == "object"  # the trigger form shows a JSON editor
    docs = (REPO_ROOT / "docs" / "watching.md").read_text()
    assert '"chaos": [{"kind": "hang", "segment": 1, "step": 75, "rank": 1}]' in docs
    assert param.resolve([{"kind": "hang", "segment": 1, "step": 75, "rank": 1}])
    with pytest.raises(Exception, match="is not of type 'object'"):
        param.resolve(['{"kind": "hang"}'])


class _NoMlflow:
    """Stands in for lineage_store: any call means an MLflow run was about to be opened."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> Any:  # noqa: ANN401
        self.calls += 1
        raise AssertionError("preflight touched MLflow before checking the chaos conf")


@pytest.mark.parametrize("chaos", [[CRASH], [{"kind": "meteor"}]])
def test_preflight_refuses_before_any_mlflow_run_is_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chaos: list[dict[str, Any]]
) -> None:
    path = spec_file(tmp_path, "chaos: allowed\n" if chaos[0]["kind"] == "meteor" else "")
    no_mlflow = _NoMlflow()
    monkeypatch.setattr(operators, "lineage_store", no_mlflow)
    op = operators.PreflightOperator(task_id="preflight", spec_file=str(path))
    context = {"dag_run": SimpleNamespace(conf={"chaos": chaos}, run_id="manual__1")}
    with pytest.raises(AirflowFailException, match="DAG run conf `chaos`"):
        op.execute(context)
    assert no_mlflow.calls == 0
    assert isinstance(load_job_spec(path), JobSpec)
