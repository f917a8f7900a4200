"""``epochs: N`` with ``steps_per_epoch`` as an alternative to ``total_steps``."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.core.exceptions import ConfigError
from relay.spec.job import load_job_spec
from relay.spec.yamlsource import Problem

REST = "steps_per_segment: 60\ncheckpoint_every: 20\n"


@pytest.fixture(autouse=True)
def policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "default.yaml").write_text("version: 1\n")
    monkeypatch.setenv("RELAY_POLICIES_DIR", str(folder))


def spec_file(tmp_path: Path, head: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text("job: demo\n" + head + REST)
    return path


def problems(path: Path) -> list[Problem]:
    with pytest.raises(ConfigError) as caught:
        load_job_spec(path)
    return caught.value.problems


def test_epochs_times_steps_per_epoch_is_total_steps(tmp_path: Path) -> None:
    spec = load_job_spec(spec_file(tmp_path, "epochs: 3\nsteps_per_epoch: 50\n"))
    assert (spec.total_steps, spec.epochs, spec.steps_per_epoch) == (150, 3, 50)
    assert spec.segments[-1] == (2, 120, 150)


def test_total_steps_alone_still_works(tmp_path: Path) -> None:
    spec = load_job_spec(spec_file(tmp_path, "total_steps: 240\n"))
    assert (spec.total_steps, spec.epochs, spec.steps_per_epoch) == (240, None, None)


def test_both_agreeing_is_fine(tmp_path: Path) -> None:
    path = spec_file(tmp_path, "epochs: 2\nsteps_per_epoch: 50\ntotal_steps: 100\n")
    assert load_job_spec(path).total_steps == 100


def test_epochs_without_steps_per_epoch_names_the_field(tmp_path: Path) -> None:
    (problem,) = problems(spec_file(tmp_path, "epochs: 3\n"))
    assert problem.field == "steps_per_epoch"
    assert problem.file == str(tmp_path / "job.yaml")
    assert "len(loader)" in problem.expected and problem.found == "nothing"
    assert "steps_per_epoch: 50" in problem.fix


def test_total_steps_disagreeing_with_epochs_is_refused(tmp_path: Path) -> None:
    (problem,) = problems(spec_file(tmp_path, "epochs: 2\nsteps_per_epoch: 50\ntotal_steps: 90\n"))
    assert (problem.field, problem.line, problem.found) == ("total_steps", 4, "90")
    assert "2 x 50 = 100" in problem.expected
    assert "total_steps: 100" in problem.fix


def test_neither_total_steps_nor_epochs(tmp_path: Path) -> None:
    (problem,) = problems(spec_file(tmp_path, ""))
    assert (problem.field, problem.found) == ("total_steps", "nothing")
    assert "epochs" in problem.expected and "epochs: 4" in problem.fix


@pytest.mark.parametrize("head", ["epochs: 0\nsteps_per_epoch: 5\n",
                                  "epochs: 2\nsteps_per_epoch: -1\n"])
def test_bad_epoch_numbers_are_reported_on_their_own_line(tmp_path: Path, head: str) -> None:
    found = problems(spec_file(tmp_path, head))
    assert [p.field for p in found] in (["epochs"], ["steps_per_epoch"]), found
    assert found[0].line in (2, 3)
