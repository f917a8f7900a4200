"""Unit tests for job specs and the YAML config helpers behind them."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import pytest

from relay.core.exceptions import ConfigError
from relay.spec.job import JobSpec, load_job_spec, load_job_specs
from relay.spec.policy_files import policies_dir
from relay.spec.yamlsource import Problem, load_yaml_with_lines, parse_duration

VALID = """\
job: demo
description: Tiny model
seed: 1234
total_steps: 240
steps_per_segment: 60
checkpoint_every: 20
nodes: 2
ranks_per_node: 2
model:
  context: 64
  d_model: 64
  n_layers: 2
  n_heads: 4
  dropout: 0.1
data:
  corpus: builtin:python_docs
  batch_size: 16
optimizer:
  lr: 0.003
  weight_decay: 0.01
policy: default
retries: 2
retry_delay: 2s
collective_timeout: 30m
heartbeat_interval: 0.5s
"""

MINIMAL = """\
job: demo
total_steps: 240
steps_per_segment: 60
checkpoint_every: 20
"""


@pytest.fixture(autouse=True)
def policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point RELAY_POLICIES_DIR at a temporary folder holding default.yaml and fast.yaml."""
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "default.yaml").write_text("version: 1\n")
    (folder / "fast.yaml").write_text("version: 1\n")
    monkeypatch.setenv("RELAY_POLICIES_DIR", str(folder))
    return folder


def write(folder: Path, name: str, text: str) -> Path:
    """Write a spec file (dedented) and return its path."""
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(path: Path) -> list[Problem]:
    """Load a spec that must be invalid and return its problems."""
    with pytest.raises(ConfigError) as info:
        load_job_spec(path)
    return info.value.problems


def only(problems: list[Problem], field: str) -> Problem:
    """Return the single problem on ``field``."""
    matching = [p for p in problems if p.field == field]
    assert len(matching) == 1, problems
    return matching[0]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1m30s", 90.0),
        ("0.5s", 0.5),
        ("2s", 2.0),
        (" 45s ", 45.0),
        ("0s", 0.0),
        ("10", 10.0),
        (3, 3.0),
        (2.5, 2.5),
        (0, 0.0),
    ],
)
def test_parse_duration_accepts(value: object, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value", ["abc", "", "5x", "1H", "5 s", "s", "1h-30m", "--5s", True, None, [1], {"s": 1}]
)
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ValueError, match=r"expected a duration such as 30s, 5m or 1h, found"):
        parse_duration(value)


@pytest.mark.parametrize("value", ["-5s", "-1", -1, -0.5, float("nan"), float("inf")])
def test_parse_duration_rejects_negative_and_non_finite(value: object) -> None:
    with pytest.raises(ValueError, match=r"expected a duration"):
        parse_duration(value)


def test_parse_duration_message_names_the_input() -> None:
    with pytest.raises(ValueError) as info:
        parse_duration("abc")
    assert str(info.value) == "expected a duration such as 30s, 5m or 1h, found 'abc'"


def test_load_yaml_with_lines_maps_nested_keys_and_list_items(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "cfg.yaml",
        """\
        # leading comment
        a: 1
        b:
          c: 2

          d:
            - x
            - y
        """,
    )
    data, lines = load_yaml_with_lines(path)
    assert data == {"a": 1, "b": {"c": 2, "d": ["x", "y"]}}
    assert lines[("a",)] == 2
    assert lines[("b",)] == 3
    assert lines[("b", "c")] == 4
    assert lines[("b", "d")] == 6
    assert lines[("b", "d", 0)] == 7
    assert lines[("b", "d", 1)] == 8
    assert lines[()] == 1


def test_valid_spec_round_trip(tmp_path: Path, policies: Path) -> None:
    path = write(tmp_path, "demo.yaml", VALID)
    spec = load_job_spec(path)
    assert spec.job == "demo"
    assert spec.dag_id == "relay_demo"
    assert spec.world_size == 4
    assert spec.model.d_model == 64 and spec.model.n_heads == 4
    assert spec.data.corpus == "builtin:python_docs"
    assert spec.optimizer.lr == pytest.approx(0.003)
    assert spec.retry_delay == 2.0
    assert spec.collective_timeout == 1800.0
    assert spec.heartbeat_interval == 0.5
    assert spec.policy_path(path) == policies / "default.yaml"
    assert spec.segments == [(0, 0, 60), (1, 60, 120), (2, 120, 180), (3, 180, 240)]
    assert JobSpec.model_validate(spec.model_dump()) == spec
    with pytest.raises(Exception, match="frozen"):
        spec.job = "other"  # type: ignore[misc]


def test_defaults_fill_in_a_minimal_spec(tmp_path: Path) -> None:
    spec = load_job_spec(write(tmp_path, "mini.yaml", MINIMAL))
    assert (spec.description, spec.seed, spec.nodes, spec.ranks_per_node) == ("", 0, 2, 2)
    assert spec.model.model_dump() == {
        "context": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "dropout": 0.1
    }
    assert spec.data.batch_size == 16 and spec.optimizer.weight_decay == 0.01
    assert (spec.policy, spec.retries) == ("default", 2)
    assert (spec.retry_delay, spec.collective_timeout, spec.heartbeat_interval) == (2, 1800, 0.5)


@pytest.mark.parametrize(
    ("total", "per_segment", "expected"),
    [
        (250, 60, [(0, 0, 60), (1, 60, 120), (2, 120, 180), (3, 180, 240), (4, 240, 250)]),
        (60, 60, [(0, 0, 60)]),
        (10, 60, [(0, 0, 10)]),
        (7, 3, [(0, 0, 3), (1, 3, 6), (2, 6, 7)]),
    ],
)
def test_segments(total: int, per_segment: int, expected: list[tuple[int, int, int]]) -> None:
    spec = JobSpec(job="s", total_steps=total, steps_per_segment=per_segment, checkpoint_every=1)
    assert spec.segments == expected


# (field, line in the file, text of the bad line, text the fix must contain)
BAD_FIELDS = [
    ("job", 1, "job: Bad_Name!", "job: demo"),
    ("total_steps", 2, "total_steps: 0", "total_steps: 240"),
    ("steps_per_segment", 3, "steps_per_segment: sixty", "steps_per_segment: 60"),
    ("seed", 5, "seed: -1", "seed: 1234"),
    ("nodes", 5, "nodes: yes", "nodes: 2"),
    ("ranks_per_node", 5, "ranks_per_node: 2.5", "ranks_per_node: 2"),
    ("model.dropout", 6, "model:\n  dropout: 1.0", "e.g. 0.1"),
    ("model.context", 6, "model:\n  context: 1", "context: 64"),
    ("data.batch_size", 7, "data:\n  corpus: builtin:x\n  batch_size: 0", "batch_size: 16"),
    ("optimizer.lr", 6, "optimizer:\n  lr: 0", "lr: 0.003"),
    ("retry_delay", 5, "retry_delay: soon", "retry_delay: 2s"),
    ("collective_timeout", 5, "collective_timeout: -30m", "collective_timeout: 30m"),
    ("heartbeat_interval", 5, "heartbeat_interval: 0s", "heartbeat_interval: 0.5s"),
]


@pytest.mark.parametrize(("field", "line", "bad", "fix"), BAD_FIELDS)
def test_bad_field_reports_file_field_line_and_fix(
    tmp_path: Path, field: str, line: int, bad: str, fix: str
) -> None:
    base = {
        "job": "job: demo",
        "total_steps": "total_steps: 240",
        "steps_per_segment": "steps_per_segment: 60",
        "checkpoint_every": "checkpoint_every: 20",
    }
    key = field.split(".")[0]
    if key in base:
        base[key] = bad
        text = "\n".join(base.values()) + "\n"
    else:
        text = "\n".join(base.values()) + "\n" + bad + "\n"
    path = write(tmp_path, "bad.yaml", text)
    problem = only(problems_of(path), field)
    assert problem.file == str(path)
    assert problem.line == line
    assert text.splitlines()[line - 1].strip().startswith(field.split(".")[-1])
    assert fix in problem.fix
    assert str(problem).startswith(f"{path}:{line}: {field}: expected ")


def test_cross_field_checks_name_the_right_field_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "cross.yaml",
        """\
        job: demo
        total_steps: 240
        steps_per_segment: 60
        checkpoint_every: 90
        model:
          n_heads: 8
          d_model: 60
        """,
    )
    problems = problems_of(path)
    every = only(problems, "checkpoint_every")
    assert every.line == 4
    assert every.found == "90"
    assert "<= steps_per_segment (60)" in every.expected
    assert "checkpoint_every: 60" in every.fix
    d_model = only(problems, "model.d_model")
    assert d_model.line == 7
    assert "multiple of model.n_heads (8)" in d_model.expected
    assert "d_model: 64" in d_model.fix and "n_heads: 6" in d_model.fix


def test_many_problems_are_reported_at_once_in_line_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "many.yaml",
        """\
        job: Demo
        total_steps: -1
        steps_per_segment: 60
        checkpoint_every: 20
        model:
          d_model: 63
        optimizer:
          lr: fast
        retry_delay: 2 seconds
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_job_spec(path)
    err = info.value
    got = [(p.field, p.line) for p in err.problems]
    assert got == [
        ("job", 1),
        ("total_steps", 2),
        ("model.d_model", 6),
        ("optimizer.lr", 8),
        ("retry_delay", 9),
    ]
    text = str(err)
    assert text.splitlines()[0] == f"{path}: 5 problems"
    assert len(text.splitlines()) == 6
    assert f"{path}:8: optimizer.lr: expected a number, found 'fast'. Fix: " in text


def test_unknown_field_suggests_the_close_name(tmp_path: Path) -> None:
    path = write(tmp_path, "typo.yaml", MINIMAL + "model:\n  nlayers: 3\nseeds: 7\n")
    problems = problems_of(path)
    nested = only(problems, "model.nlayers")
    assert nested.line == 6
    assert nested.expected.startswith("no such field (known fields: ")
    assert "n_layers" in nested.expected and nested.found == "3"
    assert "rename `nlayers` to `n_layers`" in nested.fix
    top = only(problems, "seeds")
    assert top.line == 7
    assert "rename `seeds` to `seed`" in top.fix


def test_missing_fields_point_at_the_parent(tmp_path: Path) -> None:
    path = write(tmp_path, "missing.yaml", "# a job\n\njob: demo\ntotal_steps: 10\n")
    problems = problems_of(path)
    assert {p.field for p in problems} == {"steps_per_segment", "checkpoint_every"}
    for problem in problems:
        assert (problem.line, problem.expected, problem.found) == (
            1, "this field to be set", "nothing"
        )
        assert f"{problem.field}: " in problem.fix


def test_wrong_type_for_a_section(tmp_path: Path) -> None:
    problem = only(problems_of(write(tmp_path, "s.yaml", MINIMAL + "data: 5\n")), "data")
    assert (problem.line, problem.found) == (5, "5")
    assert "mapping" in problem.expected and "batch_size: 16" in problem.fix


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "syntax.yaml", "job: demo\ntotal_steps: 240\n\tsteps_per_segment: 60\n")
    problem = problems_of(path)[0]
    assert problem.file == str(path)
    assert problem.line == 3
    assert "tab" in problem.fix
    assert str(problem).startswith(f"{path}:3: ")


def test_unclosed_bracket_is_a_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "bracket.yaml", "job: demo\nmodel: {d_model: 64\n")
    problem = problems_of(path)[0]
    assert problem.expected == "valid YAML" and problem.line is not None


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here\n", "---\n"])
def test_empty_file_is_rejected_clearly(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    [problem] = problems_of(path)
    assert (problem.line, problem.found) == (1, "an empty file")
    assert "total_steps" in problem.fix


@pytest.mark.parametrize(("text", "found"), [("- a\n- b\n", "list"), ("just text\n", "str")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, found: str) -> None:
    [problem] = problems_of(write(tmp_path, "top.yaml", text))
    assert problem.line == 1 and found in problem.found


def test_missing_policy_lists_available_policies(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", MINIMAL + "policy: agressive\n")
    problem = only(problems_of(path), "policy")
    assert problem.line == 5
    assert "agressive" in problem.found
    assert "default, fast" in problem.fix


def test_missing_policy_is_reported_with_other_problems(tmp_path: Path, policies: Path) -> None:
    (policies / "default.yaml").unlink()
    path = write(tmp_path, "p.yaml", "job: demo\ntotal_steps: 0\nsteps_per_segment: 5\n"
                 "checkpoint_every: 5\n")
    problems = problems_of(path)
    assert [p.field for p in problems] == ["policy", "total_steps"]
    assert only(problems, "policy").line == 1


def test_policy_path_relative_to_spec_folder(tmp_path: Path) -> None:
    sub = tmp_path / "jobs"
    sub.mkdir()
    (tmp_path / "custom.yml").write_text("version: 1\n")
    path = write(sub, "p.yaml", MINIMAL + "policy: ../custom.yml\n")
    spec = load_job_spec(path)
    assert spec.policy_path(path) == sub / "../custom.yml"
    assert spec.policy_path(path).resolve() == (tmp_path / "custom.yml").resolve()


def test_policies_dir_follows_env(policies: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert policies_dir() == policies
    monkeypatch.delenv("RELAY_POLICIES_DIR")
    assert policies_dir() == Path(__file__).resolve().parents[3] / "policies"


def test_load_job_specs_reports_duplicates_and_keeps_good_specs(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    first = write(jobs, "a.yaml", MINIMAL)
    second = write(jobs, "b.yml", "# copy\n" + MINIMAL)
    other = write(jobs, "c.yaml", MINIMAL.replace("job: demo", "job: other"))
    broken = write(jobs, "d.yaml", MINIMAL.replace("total_steps: 240", "total_steps: x"))
    write(jobs, "notes.txt", "not a spec")
    (jobs / "nested").mkdir()
    write(jobs / "nested", "e.yaml", MINIMAL.replace("job: demo", "job: nested"))

    specs, errors = load_job_specs(jobs)
    assert list(specs) == [first, other]
    assert list(errors) == [second, broken]
    [dup] = errors[second].problems
    assert (dup.file, dup.field, dup.line) == (str(second), "job", 2)
    assert str(first) in dup.fix and "a.yaml" in dup.expected
    assert only(errors[broken].problems, "total_steps").line == 2


def test_config_error_lists_every_problem_and_pickles() -> None:
    problems = [
        Problem("f.yaml", 3, "a.b", "a number > 0", "0", "set a.b to 1"),
        Problem("f.yaml", None, "c", "text", "5", "quote it"),
    ]
    err = ConfigError(problems)
    assert str(err).splitlines() == [
        "f.yaml: 2 problems",
        "f.yaml:3: a.b: expected a number > 0, found 0. Fix: set a.b to 1",
        "f.yaml: c: expected text, found 5. Fix: quote it",
    ]
    assert str(ConfigError(problems[:1])).splitlines()[0] == "f.yaml: 1 problem"
    assert pickle.loads(pickle.dumps(err)).problems == problems
