"""Job spec fields for devices: ``backend`` and ``deterministic`` reach the launch file."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.core.exceptions import ConfigError
from relay.spec.job import load_job_spec
from relay_train.protocol.launch import LaunchConfig

BASE = "job: demo\ntotal_steps: 240\nsteps_per_segment: 60\ncheckpoint_every: 20\n"


@pytest.fixture(autouse=True)
def policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "default.yaml").write_text("version: 1\n")
    monkeypatch.setenv("RELAY_POLICIES_DIR", str(folder))


def _spec(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(BASE + extra)
    return path


def test_defaults_are_auto_and_deterministic(tmp_path: Path) -> None:
    spec = load_job_spec(_spec(tmp_path, ""))
    assert (spec.backend, spec.deterministic) == ("auto", True)


@pytest.mark.parametrize("backend", ["auto", "gloo", "nccl"])
def test_backend_values(tmp_path: Path, backend: str) -> None:
    spec = load_job_spec(_spec(tmp_path, f"backend: {backend}\ndeterministic: false\n"))
    assert (spec.backend, spec.deterministic) == (backend, False)


@pytest.mark.parametrize(
    ("line", "field", "fix"),
    [
        ("backend: mpi", "backend", "e.g. backend: auto"),
        ("deterministic: maybe", "deterministic", "set deterministic to true"),
    ],
)
def test_bad_values_name_file_line_field_and_fix(
    tmp_path: Path, line: str, field: str, fix: str
) -> None:
    path = _spec(tmp_path, line + "\n")
    with pytest.raises(ConfigError) as err:
        load_job_spec(path)
    [problem] = err.value.problems
    assert (problem.file, problem.line, problem.field) == (str(path), 5, field)
    assert fix in problem.fix


def test_old_launch_files_still_read(tmp_path: Path) -> None:
    """A launch file written before these fields existed reads with the defaults."""
    cfg = LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=["node-a"], ranks_per_node=2, master_addr="127.0.0.1",
        master_port=1, tracking_uri=f"sqlite:///{tmp_path / 'x.db'}", run_id="r",
        attempt_dir=str(tmp_path),
        attempt=1, segment=0, backend="nccl", deterministic=False,
    )
    path = tmp_path / "launch.json"
    cfg.write(path)
    assert LaunchConfig.read(path) == cfg
    old = path.read_text().replace('"backend": "nccl",', "").replace('"deterministic": false,', "")
    assert '"backend"' not in old and '"deterministic"' not in old
    path.write_text(old)
    assert (LaunchConfig.read(path).backend, LaunchConfig.read(path).deterministic) == (
        "auto", True)
