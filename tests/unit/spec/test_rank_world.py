"""The rank's world in a job spec (entrypoint.workdir, entrypoint.env) and the preflight
that imports the entrypoint's packages in it before any node is taken."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from relay.core.exceptions import ConfigError
from relay.spec.entry_check import import_problem, script_imports
from relay.spec.job import load_job_spec
from relay_train.protocol.launch import Entrypoint
from relay_train.worker import enter_world, run_entrypoint

HEAD = """\
job: user
total_steps: 20
steps_per_segment: 10
checkpoint_every: 10
"""


def spec_file(folder: Path, entrypoint: str) -> Path:
    path = folder / "job.yaml"
    path.write_text(HEAD + f"entrypoint: {entrypoint}\n")
    return path


def test_workdir_and_env_reach_the_launch_file(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    path = spec_file(tmp_path, '{module: json.tool, workdir: work, env: {HF_HOME: /data, '
                               'TOKENIZERS_PARALLELISM: "false"}}')
    entry = load_job_spec(path).launch_entrypoint(path)
    assert entry.workdir == str(tmp_path / "work")
    assert entry.env == {"HF_HOME": "/data", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.parametrize(("env", "expected", "fix"), [
    ("{OMP: 4}", "a text value for OMP", 'quote it, e.g. env: {OMP: "4"}'),
    ("{RANK: '3'}", "variables other than torchrun's and Relay's",
     "remove RANK from entrypoint.env"),
    ("{RELAY_NODE: x}", "variables other than torchrun's and Relay's",
     "remove RELAY_NODE from entrypoint.env"),
    ("{1ST: x}", "environment variable names", "rename it"),
    ("[A, B]", "a mapping of `key: value` settings", "entrypoint.env as a mapping"),
])
def test_a_bad_env_names_the_file_the_field_and_the_fix(
        tmp_path: Path, env: str, expected: str, fix: str) -> None:
    path = spec_file(tmp_path, f"{{script: train.py, env: {env}}}")
    with pytest.raises(ConfigError) as caught:
        load_job_spec(path)
    problem = caught.value.problems[0]
    assert problem.file == str(path) and problem.field.startswith("entrypoint.env")
    assert expected in problem.expected and fix in problem.fix, problem


def test_a_missing_package_is_reported_before_launch(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import os\nimport torch\ntry:\n    import no_such_pkg_relay.sub as s\nexcept "
        "ImportError:\n    raise\n\ndef main():\n    import never_checked\n")
    assert script_imports(tmp_path / "train.py") == [
        ("os", f"{tmp_path / 'train.py'}:1"), ("torch", f"{tmp_path / 'train.py'}:2"),
        ("no_such_pkg_relay", f"{tmp_path / 'train.py'}:4")]
    path = spec_file(tmp_path, "{script: train.py}")
    problem = import_problem(load_job_spec(path), path)
    assert problem is not None
    assert "cannot import 'no_such_pkg_relay'" in problem and "train.py:4" in problem
    assert "No module named 'no_such_pkg_relay'" in problem and "pip install" in problem


def test_a_good_entrypoint_passes_with_its_workdir_and_env(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mylib_relay_check.py").write_text("VALUE = 1\n")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mypkg_relay_check").mkdir()
    (tmp_path / "work" / "mypkg_relay_check" / "__init__.py").write_text(
        "import os\nassert os.environ['NEEDED'] == 'yes'\nimport mylib_relay_check\n")
    path = spec_file(tmp_path, f"{{module: mypkg_relay_check.train, workdir: work, env: "
                               f"{{NEEDED: 'yes', PYTHONPATH: {tmp_path / 'lib'}}}}}")
    assert import_problem(load_job_spec(path), path) is None
    bare = spec_file(tmp_path, "{module: mypkg_relay_check.train}")  # not on the ranks' path
    assert "cannot import 'mypkg_relay_check'" in str(import_problem(load_job_spec(bare), bare))


def test_a_script_may_import_its_neighbours_given_a_relative_spec_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As `relay spec check jobs/job.yaml` from the repository: the script's folder is on the
    # ranks' sys.path (they run it as a script), whatever the caller's working directory.
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "helper_relay_check.py").write_text("VALUE = 1\n")
    (tmp_path / "jobs" / "train.py").write_text("import helper_relay_check\n")
    spec_file(tmp_path / "jobs", "{script: train.py}")
    monkeypatch.chdir(tmp_path)
    relative = Path("jobs") / "job.yaml"
    entry = load_job_spec(relative).launch_entrypoint(relative)
    assert entry.script == str(tmp_path / "jobs" / "train.py")
    assert import_problem(load_job_spec(relative), relative) is None


def test_a_missing_workdir_is_reported(tmp_path: Path) -> None:
    path = spec_file(tmp_path, "{module: json, workdir: nowhere}")
    assert "entrypoint.workdir: expected a folder" in str(
        import_problem(load_job_spec(path), path))


def test_the_rank_enters_its_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("RELAY_TEST_WORLD", "before")  # restored after the test
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    assert enter_world(Entrypoint(script="x.py"), attempt) is None
    assert Path.cwd() == attempt  # no workdir: the attempt folder
    work = tmp_path / "work"
    work.mkdir()
    entry = Entrypoint(module="m", workdir=str(work),
                       env={"RELAY_TEST_WORLD": "after", "PYTHONPATH": "lib"})
    assert enter_world(entry, attempt) is None
    assert Path.cwd() == work and os.environ["RELAY_TEST_WORLD"] == "after"
    assert sys.path[:2] == [str(work / "lib"), str(work)]
    problem = enter_world(Entrypoint(module="m", workdir=str(tmp_path / "gone")), attempt)
    assert problem is not None and "entrypoint.workdir" in problem


def test_a_missing_script_or_module_fails_the_rank_saying_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the watcher reports as the launch failure's summary (the rank's stderr); end to
    end, test_user_script's broken entrypoints (these two in `make test-slow`)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert run_entrypoint(Entrypoint(script=str(tmp_path / "absent.py"))) == 2
    assert f"entrypoint script {tmp_path / 'absent.py'}: no such file" in capsys.readouterr().err
    with pytest.raises(ImportError, match="No module named no_such_relay_user_module"):
        run_entrypoint(Entrypoint(module="no_such_relay_user_module"))
