"""The warden: a detected fault nobody handles is stopped within the bound, by one actor only.

The workload here is a real process group (``sleep``) behind a real local launcher handle;
the wardens are real ``python -m relay.recover.warden`` processes. Training itself is covered
by ``tests/services/test_services_faults.py`` (scheduler killed, stalled rank).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from claims import take_as_task
from processes import wait_exit

from relay.core.faults import Fault, FaultKind
from relay.core.settings import REPO_ROOT
from relay.launchers.local.launcher import HANDLE_FILE, agent_handle, group_members
from relay.policy.model import load_policy
from relay.recover import claim, warden
from relay.recover.save_state import STOP
from relay.recover.warden_record import Stopped, folder
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

DEFAULT = REPO_ROOT / "policies" / "default.yaml"




def test_plan_follows_the_policy(tmp_path: Path) -> None:
    loaded = load_policy(DEFAULT)
    steps = warden.plan(loaded.policy, [], loaded.sha256)
    assert steps["hang"] == "rescue"  # restart_elsewhere after a hang: rescue first
    assert steps["straggler"] == "drain"  # checkpoint_and_migrate: drain first
    assert steps["nan_loss"] == STOP  # rollback: the ranks' state is not wanted
    assert steps["crash"] == STOP
    # The 3rd hang of a segment escalates: no rescue, just the stop.
    again = warden.plan(loaded.policy, [FaultKind.HANG, FaultKind.HANG], loaded.sha256)
    assert again["hang"] == STOP
    observing = tmp_path / "observe.yaml"
    observing.write_text(DEFAULT.read_text().replace("mode: enforce", "mode: observe", 1))
    watch_only = load_policy(observing)
    assert warden.plan(watch_only.policy, [], watch_only.sha256) == {}


def _workload(attempt: Path) -> subprocess.Popen[bytes]:
    """A launched attempt whose only process group is a real sleeping process."""
    attempt.mkdir(parents=True)
    LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=100,
        checkpoint_every=10, nodes=["node-a"], ranks_per_node=1, master_addr="127.0.0.1",
        master_port=1, tracking_uri="file:///nowhere", run_id="r", attempt_dir=str(attempt),
        attempt=1, segment=0,
    ).write(attempt / LAUNCH_FILE)
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (attempt / HANDLE_FILE).write_text(json.dumps(
        {"nodes": {"node-a": agent_handle(proc.pid)}, "started_at": time.time()}))
    return proc


def _event(attempt: Path, detected_at: float) -> dict[str, object]:
    fault = Fault(FaultKind.CRASH, 0, "node-a", {"summary": "rank 0 exited 1"}, detected_at)
    return {**fault.to_event(), "attempt_dir": str(attempt)}


DETECTION = {"stop_unattended_after": 1.0, "checkpoint_timeout": 5.0, "evidence_timeout": 1.0}


def test_an_unhandled_fault_is_stopped_by_one_warden(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the watcher runs, Airflow forbids its metadata DB (supervisor.py sets this):
    # the warden must not even import Airflow.
    for var in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CORE__SQL_ALCHEMY_CONN"):
        monkeypatch.setenv(var, "airflow-db-not-allowed:///")
    attempt = tmp_path / "try-1"
    proc = _workload(attempt)
    try:
        event = _event(attempt, time.time())
        # Two watchers of one attempt fire: one warden starts.
        first = warden.start_warden(attempt, event, STOP, DETECTION, None)
        assert first is not None
        assert warden.start_warden(attempt, event, STOP, DETECTION, None) is None
        # A second warden started by hand races the first for the lease.
        args = folder(attempt) / "args.json"
        with (attempt / "logs" / "unattended.log").open("ab") as out:
            rival = subprocess.Popen([sys.executable, "-m", "relay.recover.warden", str(args)],
                                     stdout=out, stderr=subprocess.STDOUT)
        assert proc.wait(timeout=60) is not None  # the workload was stopped
        rival.wait(timeout=60)
        wait_exit(first)
        stopped = Stopped.read(attempt)
        assert stopped is not None and stopped.survivors == []
        assert stopped.stopped_at - stopped.detected_at >= DETECTION["stop_unattended_after"]
        assert claim.claimed_by(attempt)["by"] == "warden"
        log = (attempt / "logs" / "unattended.log").read_text()
        assert log.count("stopping the workload") == 1, log
        assert log.count("done: claimed") == 1 and log.count("done: stopped") == 1, log
        # execute_complete, when it runs, gets the warden's record.
        assert take_as_task(attempt, 5) == stopped
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_handled_fault_is_left_to_execute_complete(tmp_path: Path) -> None:
    attempt = tmp_path / "try-1"
    proc = _workload(attempt)
    try:
        pid = warden.start_warden(attempt, _event(attempt, time.time()), STOP,
                                      {**DETECTION, "stop_unattended_after": 30.0}, None)
        assert pid is not None
        assert take_as_task(attempt, 5) is None  # execute_complete takes the attempt
        wait_exit(pid, timeout=10)  # the warden leaves at its next look
        assert group_members(proc.pid) == [proc.pid]  # and never touched the workload
        assert claim.claimed_by(attempt)["by"] == "execute_complete"
        assert Stopped.read(attempt) is None
    finally:
        proc.kill()
        proc.wait()


def test_off_means_no_warden(tmp_path: Path) -> None:
    attempt = tmp_path / "try-1"
    attempt.mkdir()
    event = _event(attempt, time.time())
    assert warden.start_warden(attempt, event, STOP,
                                   {**DETECTION, "stop_unattended_after": None}, None) is None
    assert not folder(attempt).exists()


@pytest.mark.parametrize("value", ["0s", "-1s"])
def test_the_bound_must_be_positive(tmp_path: Path, value: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEFAULT.read_text().replace("stop_unattended_after: 30s",
                                               f"stop_unattended_after: {value}"))
    with pytest.raises(Exception, match="stop_unattended_after"):
        load_policy(bad)
