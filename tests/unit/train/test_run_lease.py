"""A DAG run's orchestrator lease: renewed by Relay, read by what it keeps warm for the run."""

from __future__ import annotations

import time
from pathlib import Path

from residents import ResidentRun

from relay.launchers.local.continuity import LocalContinuity
from relay.launchers.local.launcher import LocalLauncher
from relay_train.protocol import run_lease


def test_a_run_never_leased_never_lapses(tmp_path: Path) -> None:
    assert run_lease.held_until(tmp_path) is None
    assert not run_lease.lapsed(tmp_path, now=time.time() + 1e9)


def test_a_renewal_holds_the_run_until_it_lapses(tmp_path: Path) -> None:
    assert run_lease.renew(tmp_path, 30.0)
    until = run_lease.held_until(tmp_path)
    assert until is not None
    assert not run_lease.lapsed(tmp_path, now=until - 1)
    assert run_lease.lapsed(tmp_path, now=until + 1)


def test_a_renewal_never_shortens_the_lease(tmp_path: Path) -> None:
    run_lease.renew(tmp_path, 600.0)  # a retry's backoff
    held = run_lease.held_until(tmp_path)
    run_lease.renew(tmp_path, 1.0)  # a watcher's poll meanwhile
    assert run_lease.held_until(tmp_path) == held


def test_no_lease_is_written_where_the_run_folder_is_not(tmp_path: Path) -> None:
    assert not run_lease.renew(tmp_path / "elsewhere", 30.0)
    assert not (tmp_path / "elsewhere").exists()


def test_an_attempt_folder_finds_its_runs_lease(tmp_path: Path) -> None:
    attempt = tmp_path / "run" / "segment-000" / "try-1"
    attempt.mkdir(parents=True)
    assert not run_lease.attempt_lapsed(attempt)
    (tmp_path / "run" / run_lease.LEASE_FILE).write_text('{"until": 1.0}')
    assert run_lease.attempt_lapsed(attempt)
    assert not run_lease.attempt_lapsed(Path("/try-1"))  # in no run's folder


def test_the_local_continuity_renews_the_runs_lease(tmp_path: Path) -> None:
    LocalContinuity(LocalLauncher()).keep_run(tmp_path, 45.0)
    until = run_lease.held_until(tmp_path)
    assert until is not None and until > time.time()


def test_a_resident_leaves_once_its_runs_lease_lapses_though_ranks_still_beat(
        resident_run: ResidentRun) -> None:
    resident_run.ranks_beat_for(3600.0)  # a workload its dead orchestrator left training
    (resident_run.run / run_lease.LEASE_FILE).write_text('{"until": 1.0}')  # nobody renews it
    assert resident_run.resident(idle_seconds=3600.0).run() == 0
    assert not resident_run.ready()
