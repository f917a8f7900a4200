"""checkpoint_every: auto: the Young/Daly formula, its inputs, its bounds, its spec syntax."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relay.core.exceptions import ConfigError
from relay.lineage.interval import (
    DEFAULT_CHECKPOINT_COST_SECONDS,
    DEFAULT_MTBF_SECONDS,
    FALLBACK_CHECKPOINTS_PER_SEGMENT,
    INTERVAL_FILE,
    JobHistory,
    bounded,
    choose_interval,
    interval_for,
    read_history,
    young_daly_seconds,
)
from relay.lineage.store import Lineage
from relay.spec.job import AutoInterval, JobSpec, load_job_spec


def _spec(every: object = "auto", per_segment: int = 100) -> JobSpec:
    return JobSpec.model_validate({"job": "j", "total_steps": 400,
                                   "steps_per_segment": per_segment, "checkpoint_every": every})


@pytest.mark.parametrize(("cost", "mtbf"), [(1.0, 86400.0), (0.02, 50.0), (0.0, 10.0),
                                            (3.5, 7.25)])
def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf(cost: float, mtbf: float) -> None:
    seconds = young_daly_seconds(cost, mtbf)
    assert seconds == pytest.approx(math.sqrt(2 * cost * mtbf))
    # The optimum balances checkpoint overhead C/T against expected loss T/(2M).
    if cost > 0:
        assert cost / seconds == pytest.approx(seconds / (2 * mtbf))


def test_young_daly_refuses_a_non_positive_mtbf() -> None:
    with pytest.raises(ValueError, match="MTBF"):
        young_daly_seconds(1.0, 0.0)


@pytest.mark.parametrize(("steps", "expected"), [(3, (5, "min")), (5, (5, None)), (40, (40, None)),
                                                 (50, (50, None)), (51, (50, "max"))])
def test_bounded(steps: int, expected: tuple[int, str | None]) -> None:
    assert bounded(steps, 5, 50) == expected


def test_measured_history_gives_the_formula_in_steps() -> None:
    history = JobHistory(attempts=4, exposure_seconds=400.0, faults=2,
                         stall_seconds=[0.01, 0.03, 0.02], step_seconds=[0.05, 0.04, 0.06])
    choice = choose_interval(_spec({"auto": True, "min": 2, "max": 100}), history)
    # C = 0.02 s (median), M = 400 / 2 = 200 s, T = sqrt(8) = 2.83 s, at 0.05 s/step.
    assert choice.checkpoint_cost_seconds == pytest.approx(0.02)
    assert choice.mtbf_seconds == pytest.approx(200.0)
    assert choice.young_daly_seconds == pytest.approx(math.sqrt(2 * 0.02 * 200), abs=1e-3)
    assert choice.step_seconds == pytest.approx(0.05)
    assert choice.steps == choice.unbounded_steps == round(math.sqrt(8.0) / 0.05)
    assert choice.bound_hit is None
    assert choice.mode == "auto"
    assert "sqrt(2 x" in choice.reason and f"= {choice.steps} steps" in choice.reason


def test_bounds_hold_the_interval_and_say_so() -> None:
    rare = JobHistory(attempts=3, exposure_seconds=90.0, faults=0, stall_seconds=[0.5],
                      step_seconds=[0.01])
    high = choose_interval(_spec({"auto": True, "min": 5, "max": 40}), rare)
    assert (high.steps, high.bound_hit) == (40, "max")
    assert high.unbounded_steps is not None and high.unbounded_steps > 40
    assert "held at the max bound 40" in high.reason
    often = JobHistory(attempts=3, exposure_seconds=3.0, faults=3, stall_seconds=[0.001],
                       step_seconds=[1.0])
    low = choose_interval(_spec({"auto": True, "min": 5, "max": 40}), often)
    assert (low.steps, low.bound_hit) == (5, "min")
    assert low.unbounded_steps == 1


def test_more_faults_mean_more_frequent_checkpoints() -> None:
    spec = _spec({"auto": True, "min": 1, "max": 100})
    calm = JobHistory(5, 1000.0, 1, [0.05], [0.1])
    stormy = JobHistory(5, 1000.0, 10, [0.05], [0.1])
    assert choose_interval(spec, stormy).steps < choose_interval(spec, calm).steps


def test_no_history_uses_the_stated_defaults() -> None:
    choice = choose_interval(_spec("auto", per_segment=100), JobHistory())
    assert choice.checkpoint_cost_seconds == DEFAULT_CHECKPOINT_COST_SECONDS
    assert choice.mtbf_seconds == DEFAULT_MTBF_SECONDS
    assert choice.steps == 100 // FALLBACK_CHECKPOINTS_PER_SEGMENT
    assert "no step time measured yet" in choice.reason
    assert choice.step_source == "not measured yet"


def test_a_clean_record_longer_than_the_default_mtbf_counts_as_is() -> None:
    long = JobHistory(10, 3 * DEFAULT_MTBF_SECONDS, 0, [0.1], [1.0])
    assert choose_interval(_spec(), long).mtbf_seconds == pytest.approx(3 * DEFAULT_MTBF_SECONDS)


def test_a_fixed_interval_is_recorded_as_fixed(tmp_path: Path) -> None:
    choice = choose_interval(_spec(20), JobHistory(3, 10.0, 3, [1.0], [1.0]))
    assert (choice.steps, choice.mode) == (20, "fixed")
    assert choice.params() == {"checkpoint_every": "20",
                               "checkpoint_every_reason": "fixed: checkpoint_every 20 in the spec"}
    choice.record(tmp_path / "try-1")
    assert '"mode": "fixed"' in (tmp_path / "try-1" / INTERVAL_FILE).read_text()


def test_history_is_read_from_the_jobs_attempt_runs_in_mlflow(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lineage = Lineage(uri, tmp_path / "artifacts")
    assert read_history(lineage, "j") == JobHistory()  # no experiment: nothing created
    exp = lineage.experiment_id("j")
    client = MlflowClient(uri)
    for n, (fault, stall, step) in enumerate([(None, 0.02, 0.1), ("crash", None, 0.3),
                                              (None, 0.04, None)]):
        run = client.create_run(exp, start_time=1_000_000 + n * 100_000,
                                tags={"relay.segment": "0", "relay.try_number": str(n + 1),
                                      **({"relay.fault_kind": fault} if fault else {})})
        for key, value in (("checkpoint_stall_seconds", stall), ("step_seconds", step)):
            if value is not None:
                client.log_metric(run.info.run_id, key, value, step=1)
        client.set_terminated(run.info.run_id, end_time=1_000_000 + n * 100_000 + 10_000)
    client.create_run(exp, tags={"relay.dag_run_id": "r"})  # a DAG run's parent: not counted
    history = read_history(lineage, "j")
    assert history.attempts == 3 and history.faults == 1
    assert history.exposure_seconds == pytest.approx(30.0)
    assert sorted(history.stall_seconds) == [0.02, 0.04]
    assert sorted(history.step_seconds) == [0.1, 0.3]
    choice = interval_for(_spec({"auto": True, "min": 1, "max": 100}), lineage)
    assert choice.mtbf_seconds == pytest.approx(30.0)  # 30 s of attempts, one fault
    assert choice.steps == round(math.sqrt(2 * 0.03 * 30.0) / 0.2)


# -- the spec syntax ------------------------------------------------------------------

BASE = "job: t\ntotal_steps: 100\nsteps_per_segment: 50\n"


@pytest.mark.parametrize(("text", "bounds"), [
    ("auto", (1, 50)),
    ("{auto: true, min: 5}", (5, 50)),
    ("{auto: true, min: 5, max: 20}", (5, 20)),
    ("\n  auto: true\n  max: 50", (1, 50)),
    ("20", (20, 20)),
])
def test_spec_accepts_auto_and_numbers(tmp_path: Path, text: str, bounds: tuple[int, int]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(BASE + f"checkpoint_every: {text}\n")
    spec = load_job_spec(path)
    assert spec.checkpoint_bounds == bounds
    assert isinstance(spec.checkpoint_every, int) == (text == "20")
    if text != "20":
        assert isinstance(spec.checkpoint_auto, AutoInterval)
        assert spec.checkpoint_every_text().startswith("auto (")


@pytest.mark.parametrize(("text", "line", "field", "expected", "fix"), [
    ("sometimes", 4, "checkpoint_every", "auto, or {auto: true", "or to auto"),
    ("true", 4, "checkpoint_every", "a whole number of steps > 0", "or to auto"),
    ("0", 4, "checkpoint_every", "a number > 0", "checkpoint_every: 20"),
    ("{auto: true, min: 0}", 4, "checkpoint_every.min", "a number >= 1", "e.g. min: 10"),
    ("\n  auto: true\n  mn: 3", 6, "checkpoint_every.mn", "no such field", "rename `mn` to `min`"),
    ("\n  auto: true\n  min: 2\n  max: 80", 4, "checkpoint_every",
     "checkpoint_every.max <= steps_per_segment (50)", "lower checkpoint_every.max"),
    ("{auto: true, min: 40, max: 30}", 4, "checkpoint_every",
     "checkpoint_every.min <= checkpoint_every.max (30)", "lower checkpoint_every.min"),
    ("{auto: false}", 4, "checkpoint_every.auto", "one of True", "auto: true"),
])
def test_spec_errors_name_line_field_expected_and_fix(
    tmp_path: Path, text: str, line: int, field: str, expected: str, fix: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(BASE + f"checkpoint_every: {text}\n")
    with pytest.raises(ConfigError) as caught:
        load_job_spec(path)
    [problem] = caught.value.problems
    assert (problem.line, problem.field) == (line, field), problem
    assert expected in problem.expected, problem
    assert fix in problem.fix, problem
    assert "~" not in str(problem)  # pydantic's union tags never reach the user


def test_explain_job_says_how_the_interval_is_chosen(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from relay.policy.explain import explain_job

    monkeypatch.setenv("RELAY_MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    text = explain_job(_spec({"auto": True, "min": 4, "max": 40}))
    assert "checkpoint_every is auto" in text and "held within 4..40 steps" in text
    assert "An attempt starting now: auto: 25 steps; no step time measured yet" in text
    assert explain_job(_spec(20)) == "Checkpoints: every 20 steps (fixed in the spec)."
