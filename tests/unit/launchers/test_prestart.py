"""A resident agent prestarted before its DAG run: the conf that names it, the take,
the release, and the resident's own wait for a take."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import write_heartbeat_for

from relay.launchers.local import prestart as local_prestart
from relay.launchers.local.launcher import LocalLauncher
from relay.launchers.local.prestart import (
    CONF_KEY,
    DAG_FILE,
    HOST,
    prestarted,
    release_untaken,
    residents_dir,
    take,
)
from relay.launchers.local.warm_agents import live_resident, record, recorded_pid, release_run
from relay_train.agent import resident
from relay_train.agent.resident import NOT_TAKEN, RESIDENT_DIR, TAKEN_BY_FILE, Resident


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path))
    return tmp_path


def _sleeper() -> subprocess.Popen[bytes]:
    """A live process in a session of its own, to stand in for a resident."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)


def _folder(home: Path, pid: int | None, name: str = "abc123") -> Path:
    folder = residents_dir(home) / name
    folder.mkdir(parents=True)
    (folder / DAG_FILE).write_text("relay_demo")
    if pid is not None:
        record(folder, HOST, pid)
    return folder


def test_the_conf_names_a_prestarted_resident_only_in_this_homes_residents_folder(
        home: Path) -> None:
    mine = _folder(home, None)
    assert prestarted({CONF_KEY: str(mine), "chaos": []}, "relay_demo") == mine
    assert prestarted({CONF_KEY: str(mine)}, "relay_other") is None, "another DAG's resident"
    elsewhere = home / "elsewhere" / "abc123"
    elsewhere.mkdir(parents=True)
    (elsewhere / DAG_FILE).write_text("relay_demo")
    for refused in (str(elsewhere), str(residents_dir(home)), str(residents_dir(home) / "gone"),
                    str(residents_dir(home) / ".." / "x"), "/etc", "", "/a\x00/b", 7, ["x"]):
        assert prestarted({CONF_KEY: refused}, "relay_demo") is None, refused
    assert prestarted({"chaos": []}, "relay_demo") is None
    assert prestarted(None, "relay_demo") is None


def test_a_run_takes_a_live_prestarted_resident_once(home: Path) -> None:
    proc = _sleeper()
    try:
        folder = _folder(home, proc.pid)
        run, other = home / "runs" / "dag" / "run-1", home / "runs" / "dag" / "run-2"
        assert take(run, folder)
        assert (run / RESIDENT_DIR).resolve() == folder.resolve()
        assert (folder / TAKEN_BY_FILE).read_text() == str(run)
        assert live_resident(run / RESIDENT_DIR) == HOST  # the launcher finds it there
        assert not take(other, folder), "a second run took the same resident"
        assert not (other / RESIDENT_DIR).exists()
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith(TAKEN_BY_FILE)) == \
            [TAKEN_BY_FILE], "a staged take file was left"
        release_untaken(folder)
        assert proc.poll() is None, "a taken resident was stopped"
        release_run(run)  # the run's end stops it, through the link
        assert proc.wait(timeout=10) == -signal.SIGTERM
        gone = home / "runs" / "dag" / "run-3"
        gone.mkdir()
        (gone / RESIDENT_DIR).symlink_to(home / "deleted")  # a dangling link is the run's too
        untaken = _folder(home, proc.pid, "def456")
        assert not take(gone, untaken)
        assert not (untaken / TAKEN_BY_FILE).exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_prestarted_resident_is_not_taken_and_the_launcher_starts_its_own(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _sleeper()
    proc.kill()
    proc.wait()
    folder = _folder(home, proc.pid)
    started: list[list[str]] = []
    monkeypatch.setattr("relay.launchers.local.warm_start.start_recorded",
                        lambda args, directory, node, env=None: started.append(args) or 1)
    run = home / "runs" / "dag" / "run-1"
    LocalLauncher().reside(run, ["node-a"], folder)
    assert not (run / RESIDENT_DIR).is_symlink()
    assert started and started[0][0] == "relay_train.agent.resident"
    assert not (folder / TAKEN_BY_FILE).exists()


def test_an_untaken_prestarted_resident_is_stopped_and_no_run_can_take_it_then(
        home: Path) -> None:
    proc = _sleeper()
    try:
        folder = _folder(home, proc.pid)
        release_untaken(folder)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert recorded_pid(folder, HOST) is None
        record(folder, HOST, os.getpid())  # even were it alive: released is taken
        assert not take(home / "runs" / "dag" / "run-1", folder)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_within(resident_: Resident, seconds: float) -> float:
    """Run a resident in a thread; fail (and stop it) unless it leaves within
    ``seconds``; return how long it ran."""
    started = time.monotonic()
    thread = threading.Thread(target=resident_.run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        resident_.stopping = True
        pytest.fail(f"the resident did not leave within {seconds}s")
    return time.monotonic() - started


def test_a_prestarted_resident_leaves_unless_taken_in_time_and_cannot_be_taken_then(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resident.signal, "signal", lambda *_: None)  # pytest's own SIGTERM
    monkeypatch.setattr(Resident, "preload", lambda self: 0.0)
    took = _run_within(Resident(tmp_path, HOST, idle_seconds=600, take_within=0.3), 30)
    assert took >= 0.3
    assert (tmp_path / TAKEN_BY_FILE).read_text() == "", "it left without taking the take"


def test_a_taken_resident_watches_the_heartbeats_of_the_run_that_took_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resident, "IDLE_CHECK_SECONDS", 0.05)
    monkeypatch.setattr(resident.signal, "signal", lambda *_: None)
    monkeypatch.setattr(Resident, "preload", lambda self: 0.0)
    folder, run = tmp_path / "residents" / "abc", tmp_path / "runs" / "run-1"
    folder.mkdir(parents=True)
    (folder / TAKEN_BY_FILE).write_text(str(run))
    beat = run / "segment-000" / "try-1" / "heartbeats" / "rank-0.json"
    beat.parent.mkdir(parents=True)
    write_heartbeat_for(beat, 1.2)
    took = _run_within(Resident(folder, HOST, idle_seconds=0.3, take_within=0.1), 30)
    assert took >= 1.2, "left while the taking run wrote heartbeats"


def test_make_down_stops_prestarted_residents_taken_or_not(home: Path) -> None:
    from relay.tools import services

    procs = [_sleeper(), _sleeper()]
    try:
        _folder(home, procs[0].pid, "untaken")
        take(home / "runs" / "dag" / "run-1", _folder(home, procs[1].pid, "taken"))
        assert services.stop_workloads(home / "runs", residents_dir(home)) == []
        assert [p.wait(timeout=10) for p in procs] == [-signal.SIGTERM] * 2
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_prestart_starts_a_recorded_resident_in_a_folder_of_its_own(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], Path, str, dict[str, str] | None]] = []
    monkeypatch.setattr(local_prestart, "start_recorded",
                        lambda args, directory, node, env=None:
                        calls.append((args, directory, node, env)) or os.getpid())
    env = {"RELAY_HOME": str(home), "OMP_NUM_THREADS": "1"}
    folder = local_prestart.prestart_resident(home, "relay_demo", env)
    assert folder.parent == residents_dir(home) and folder.is_dir()
    assert (folder / DAG_FILE).read_text() == "relay_demo"
    (args, directory, node, passed), = calls
    assert directory == folder and node == HOST and passed == env
    assert args[:3] == ["relay_train.agent.resident", "--dir", str(folder)]
    assert "--take-within" in args


def test_the_runner_prestarts_only_for_a_job_dag_on_the_local_launcher(tmp_path: Path) -> None:
    from relay.tools.demo import starts_resident

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "tiny.yaml").write_text(
        "job: tiny\nseed: 1\ntotal_steps: 20\nsteps_per_segment: 10\ncheckpoint_every: 5\n"
        "nodes: 1\nranks_per_node: 2\n"
        "model: {context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}\n"
        'data: {corpus: "builtin:python_docs", batch_size: 8}\n')
    env = {"RELAY_JOBS_DIR": str(jobs)}
    assert starts_resident("relay_tiny", env)
    assert not starts_resident("relay_watch_external", env), "a DAG without preflight"
    assert not starts_resident("relay_tiny", {"RELAY_JOBS_DIR": str(tmp_path / "none")})
    (jobs / "tiny.yaml").write_text((jobs / "tiny.yaml").read_text() + "launcher: kubernetes\n"
                                    "kubernetes: {image: relay:test}\n")
    assert not starts_resident("relay_tiny", env), "a Kubernetes job starts no local resident"


def _age_by(folder: Path, seconds: float) -> None:
    for path in folder.iterdir():
        st = path.stat()
        os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_prestarting_removes_the_folders_of_untaken_residents_that_left(home: Path) -> None:
    proc = _sleeper()
    try:
        released = _folder(home, None, "released")  # released by its runner, gone since
        assert resident.take_resident(released, NOT_TAKEN)
        orphan = _folder(home, None, "orphan")  # its runner died; it left untaken
        just_released = _folder(home, None, "just-released")
        assert resident.take_resident(just_released, NOT_TAKEN)
        _folder(home, None, "starting")  # not recorded yet: just made
        alive = _folder(home, proc.pid, "alive")  # untaken in time, still leaving
        assert resident.take_resident(alive, NOT_TAKEN)
        run = home / "runs" / "dag" / "run-1"
        taken = _folder(home, None, "taken")  # a run's: its link points here
        assert resident.take_resident(taken, str(run))
        for folder in (released, alive, taken):
            _age_by(folder, local_prestart.PRUNE_AFTER_SECONDS + 5)
        _age_by(orphan, 2 * local_prestart.TAKE_WITHIN_SECONDS + 5)
        (residents_dir(home) / "stray-file").write_text("not a folder")
        assert local_prestart.prune_untaken(home) == [orphan, released]
        assert {p.name for p in residents_dir(home).iterdir()} == {
            "just-released", "starting", "alive", "taken", "stray-file"}
    finally:
        proc.kill()
        proc.wait()
