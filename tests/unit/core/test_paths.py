"""Paths from run conf or DAG params cannot reach outside where they belong."""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from relay.core.exceptions import ConfigError, PathEscapeError
from relay.core.paths import inside, safe_name
from relay.core.settings import runs_dir
from relay.operators.base import segment_dir
from relay.spec.job import JobSpec, load_job_spec
from relay.watch.sensors import HeartbeatSensor
from relay_train.examples.data import load_corpus


def test_inside_accepts_children_and_refuses_escapes(tmp_path: Path) -> None:
    (tmp_path / "jobs" / "a").mkdir(parents=True)
    assert inside(tmp_path / "jobs" / "a", [tmp_path / "jobs"], "f", "fix") == (
        tmp_path / "jobs" / "a").resolve()
    for escape in (tmp_path / "jobs" / ".." / "x", "/etc", tmp_path / "jobsX"):
        with pytest.raises(PathEscapeError, match=r"f: expected a path inside .* Fix: fix"):
            inside(escape, [tmp_path / "jobs"], "f", "fix")
    (tmp_path / "jobs" / "link").symlink_to("/etc")
    with pytest.raises(PathEscapeError):
        inside(tmp_path / "jobs" / "link", [tmp_path / "jobs"], "f", "fix")


@pytest.mark.parametrize("run_id", ["..", ".", "../../x", ".hidden", "a/../../b", ""])
def test_a_dag_run_id_never_leaves_the_runs_folder(run_id: str) -> None:
    spec = JobSpec(job="j", total_steps=2, steps_per_segment=1, checkpoint_every=1)
    folder = segment_dir(spec, run_id, 0)
    assert folder.resolve().is_relative_to(runs_dir().resolve() / spec.dag_id)
    assert folder.parent.name == safe_name(run_id) and folder.parent.name not in (".", "..")


def sensor(heartbeat_dir: str, policy_file: str, roots: list[str]) -> HeartbeatSensor:
    return HeartbeatSensor(task_id="hb", heartbeat_dir=heartbeat_dir, world_size=1,
                           policy_file=policy_file, confine_to=roots)


def test_the_watch_dags_param_paths_are_confined(tmp_path: Path) -> None:
    roots = [str(tmp_path / "watch")]
    with pytest.raises(AirflowFailException, match="heartbeat_dir: expected a path inside"):
        sensor("/etc", "", roots)._trigger()
    with pytest.raises(AirflowFailException, match="heartbeat_dir"):
        sensor(str(tmp_path / "watch" / ".." / "other"), "", roots)._trigger()
    with pytest.raises(AirflowFailException, match="policy_file: expected a path inside"):
        sensor(str(tmp_path / "watch" / "hb"), "/etc/passwd", roots)._trigger()
    assert sensor(str(tmp_path / "watch" / "hb"), "", roots)._trigger().world_size == 1
    # A DAG author's own literal path (no confine_to) is theirs to choose.
    assert HeartbeatSensor(task_id="x", heartbeat_dir="/srv/hb", world_size=1)._trigger()


def test_a_builtin_corpus_is_a_name_not_a_path(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("job: j\ntotal_steps: 2\nsteps_per_segment: 1\ncheckpoint_every: 1\n"
                    "data:\n  corpus: builtin:../../../etc/passwd\n")
    with pytest.raises(ConfigError, match=r"job.yaml:6: data.corpus: expected builtin:<name>"):
        load_job_spec(spec)
    with pytest.raises(ValueError, match="expected builtin:<name>"):
        load_corpus("builtin:../heartbeat")
    assert len(load_corpus("builtin:python_docs")) > 0
