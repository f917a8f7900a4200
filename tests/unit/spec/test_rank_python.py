"""The spec's entrypoint.python: its errors (file, line, field, fix), the import preflight
in that interpreter, and ``relay spec venv`` (a venv layered on Relay's environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from relay.core.exceptions import ConfigError, RelayError
from relay.operators import base as operators
from relay.spec import entry_check
from relay.spec.entry_check import import_problem
from relay.spec.job import load_job_spec
from relay.tools.cli import main
from relay.tools.rank_venv import LAYER_FILE, make_rank_venv, relay_site_folders

HEAD = """\
job: user
total_steps: 20
steps_per_segment: 10
checkpoint_every: 10
entrypoint:
  script: train.py
"""
# Relay's worker side as its stdlib part: torch and MLflow take seconds to import.
STDLIB_WORKER = [("relay_train.protocol.interpreter", "Relay's worker side")]


def spec_with(folder: Path, python: str, script: str = "import json\n") -> Path:
    (folder / "train.py").write_text(script)
    path = folder / "job.yaml"
    path.write_text(HEAD + f"  python: {python}\n")
    return path


def site_of(python: Path) -> Path:
    return Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())


@pytest.fixture(name="venv")
def fixture_venv(tmp_path: Path) -> Path:
    """Return the interpreter of a venv made as ``relay spec venv --without-pip`` makes it."""
    assert main(["spec", "venv", "--without-pip", str(tmp_path / "venv")]) == 0
    return tmp_path / "venv" / "bin" / "python"


@pytest.mark.parametrize("python", ["3", "''", "[a, b]"])
def test_a_python_that_is_not_a_path_names_file_line_field_and_fix(
        tmp_path: Path, python: str) -> None:
    path = spec_with(tmp_path, python)
    with pytest.raises(ConfigError) as caught:
        load_job_spec(path)
    problem = caught.value.problems[0]
    assert (problem.file, problem.line, problem.field) == (str(path), 7, "entrypoint.python")
    assert "relay spec venv DIR" in problem.fix, problem


def test_a_missing_interpreter_fails_the_preflight_naming_file_line_and_field(
        tmp_path: Path) -> None:
    path = spec_with(tmp_path, "venvs/gone")
    problem = str(import_problem(load_job_spec(path), path))
    assert problem.startswith(f"{path}:7: entrypoint.python: expected a Python interpreter")
    assert f"found nothing at {tmp_path / 'venvs' / 'gone'}" in problem
    assert "relay spec venv DIR" in problem


def test_an_executable_that_is_not_python_fails_the_preflight(tmp_path: Path) -> None:
    fake = tmp_path / "not-python"
    fake.write_text("#!/bin/sh\nexit 0\n")  # starts and exits 0, as /bin/true would
    fake.chmod(0o755)
    path = spec_with(tmp_path, str(fake))
    problem = str(import_problem(load_job_spec(path), path))
    assert problem.startswith(f"{path}:7: entrypoint.python: expected a Python interpreter "
                              f"that runs Relay's import check, found {fake} that exited 0")
    assert "relay spec venv DIR" in problem


def test_an_import_that_prints_at_exit_still_passes(tmp_path: Path) -> None:
    (tmp_path / "noisy.py").write_text("import atexit\natexit.register(print, 'bye')\n")
    (tmp_path / "train.py").write_text("import noisy\n")
    path = tmp_path / "job.yaml"
    path.write_text(HEAD)  # Relay's own interpreter
    assert import_problem(load_job_spec(path), path) is None


def test_the_venv_is_layered_on_relays_environment(venv: Path) -> None:
    layer = (site_of(venv) / LAYER_FILE).read_text()
    assert all(repr(folder) in layer for folder in relay_site_folders())
    seen = json.loads(subprocess.run(
        [str(venv), "-c", "import importlib.util, json, sys; print(json.dumps({'prefix': "
         "sys.prefix, 'torch': importlib.util.find_spec('torch').origin}))"],
        capture_output=True, text=True, check=True).stdout)
    assert seen["prefix"] == str(venv.parent.parent)  # its own interpreter, not Relay's
    assert Path(seen["torch"]).is_relative_to(relay_site_folders()[0])  # Relay's torch


def test_a_package_of_the_venv_shadows_relays(venv: Path) -> None:
    own = site_of(venv) / "tenacity"  # Relay has one; the venv's comes first
    own.mkdir()
    (own / "__init__.py").write_text("")
    origin = subprocess.run([str(venv), "-c", "import tenacity; print(tenacity.__file__)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert origin == str(own / "__init__.py")


def test_the_preflight_finds_a_package_only_the_venv_has(
        tmp_path: Path, venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry_check, "WORKER_IMPORTS", STDLIB_WORKER)
    script = "import json\nimport venv_only_pkg\n"
    path = spec_with(tmp_path, "venv", script)
    problem = str(import_problem(load_job_spec(path), path))  # not there yet
    assert f"the ranks cannot import 'venv_only_pkg' ({tmp_path / 'train.py'}:2)" in problem
    assert f"with {venv}, working directory" in problem
    assert f"install it into the ranks' environment ({venv} -m pip install" in problem

    (site_of(venv) / "venv_only_pkg.py").write_text("")  # as pip would put it there
    assert import_problem(load_job_spec(path), path) is None
    # The check ran in the venv: with Relay's own interpreter the package is missing.
    (tmp_path / "relays").mkdir()
    relays = spec_with(tmp_path / "relays", "x", script)
    relays.write_text(HEAD)  # no entrypoint.python: Relay's own
    assert "cannot import 'venv_only_pkg'" in str(import_problem(load_job_spec(relays),
                                                                 relays))


def test_a_venv_without_relays_worker_side_is_named(tmp_path: Path) -> None:
    bare = tmp_path / "bare"  # a plain venv on the base interpreter: no torch
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(bare)],  # type: ignore[attr-defined]
                   check=True)
    path = spec_with(tmp_path, "bare")
    assert load_job_spec(path).launch_entrypoint(path).python == str(bare / "bin" / "python")
    problem = str(import_problem(load_job_spec(path), path))
    assert problem.startswith(f"{path}:7: entrypoint.python: the ranks cannot import "
                              "'relay_train.api' (Relay's worker side"), problem
    assert "No module named" in problem and f"{bare / 'bin' / 'python'} -m pip install" in problem
    assert "relay spec venv DIR makes one" in problem


def test_the_dags_preflight_refuses_it_before_any_node_or_mlflow_run(
        tmp_path: Path, venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry_check, "WORKER_IMPORTS", STDLIB_WORKER)
    path = spec_with(tmp_path, "venv", "import venv_only_pkg\n")
    touched: list[str] = []
    monkeypatch.setattr(operators, "lineage_store", lambda: touched.append("mlflow"))
    monkeypatch.setattr(operators, "NodePool", lambda *_, **__: touched.append("nodes"))
    preflight = operators.PreflightOperator(task_id="preflight", spec_file=str(path))
    with pytest.raises(AirflowFailException, match=f"cannot import 'venv_only_pkg'.*{venv}"):
        preflight.execute({"dag_run": SimpleNamespace(conf={}, run_id="manual__1")})
    assert touched == []


def test_a_venv_is_not_made_over_files(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(RelayError, match="expected a new or empty folder"):
        make_rank_venv(tmp_path / "taken", with_pip=False)
    assert main(["spec", "venv", str(tmp_path / "taken")]) == 2
